/*
 * detok_stream — turns one choice's generated tokens into the text a client
 * sees: incremental detokenization (model/tokenizer's stream decoder, which
 * never emits half a UTF-8 character) followed by stop-string matching with
 * holdback.  Text that could still be the beginning of a stop string is held
 * back (at most longest_stop - 1 bytes, never splitting a character), so a
 * stop string is never partially emitted; when a stop string completes the
 * text before it is released (plus the stop itself when include_stop is set,
 * as vLLM's include_stop_str_in_output) and the stream is stopped.  The
 * released text over a whole stream equals vLLM's output text: the decoded
 * tokens, truncated at the earliest stop string.
 */
#ifndef DISAGG_SERVER_DETOK_STREAM_H
#define DISAGG_SERVER_DETOK_STREAM_H

#include "model/tokenizer.h"
#include "server/sbuf.h"

#include <stdbool.h>
#include <stdint.h>

typedef struct detok_stream {
    const tokenizer *tok; /* decoder; NULL when only text is pushed (tests) */
    tokenizer_stream ts;  /* pending bytes of an unfinished character */
    char *scratch;        /* (scratch_cap) output of one decoder push */
    size_t scratch_cap;   /* TOKENIZER_STREAM_OUT_CAP(tok) */
    char *const *stops;   /* (n_stops) stop strings, borrowed from the request */
    int n_stops;          /* 0: no stop strings, nothing is held back */
    size_t max_stop;      /* longest stop string in bytes */
    bool include_stop;    /* release the matched stop string too */
    sbuf held;            /* decoded text not yet released */
    int stop_index;       /* index of the matched stop string, -1 while running */
    bool stops_off;       /* stop strings not checked yet (before min_tokens) */
} detok_stream;

/* stops must outlive the stream.  Returns 0 or -ENOMEM. */
int detok_stream_init(detok_stream *d, const tokenizer *tok, bool skip_special, char *const *stops,
                      int n_stops, bool include_stop);
void detok_stream_free(detok_stream *d);

/* Feed one token (needs tok) or a piece of text; the text that is now safe to
 * show is appended to out.  Returns 0 while running, 1 when a stop string
 * matched (d->stop_index says which; later pushes are ignored and return 1),
 * or a negative errno (bad token id, out full). */
int detok_stream_push_token(detok_stream *d, int32_t id, sbuf *out);
int detok_stream_push_text(detok_stream *d, const char *text, size_t n, sbuf *out);
/* Stop strings are not looked for while off (vLLM ignores them before
 * min_tokens): text passes straight through.  Turning them on searches only
 * text pushed from then on. */
void detok_stream_set_stops(detok_stream *d, bool on);
/* End of generation: flushes the decoder and releases held text (no stop
 * string can complete any more).  Returns 0, 1 if already stopped, or < 0. */
int detok_stream_finish(detok_stream *d, sbuf *out);

#endif
