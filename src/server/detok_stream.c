/*
 * detok_stream — incremental detokenization with stop-string holdback (see
 * detok_stream.h).
 */
#include "server/detok_stream.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int detok_stream_init(detok_stream *d, const tokenizer *tok, bool skip_special, char *const *stops,
                      int n_stops, bool include_stop) {
    memset(d, 0, sizeof *d);
    d->tok = tok;
    tokenizer_stream_init(&d->ts, skip_special);
    if (tok) {
        d->scratch_cap = TOKENIZER_STREAM_OUT_CAP(tok);
        d->scratch = malloc(d->scratch_cap);
        if (!d->scratch) return -ENOMEM;
    }
    d->stops = stops;
    d->n_stops = n_stops;
    for (int i = 0; i < n_stops; i++) {
        size_t l = strlen(stops[i]);
        if (l > d->max_stop) d->max_stop = l;
    }
    d->include_stop = include_stop;
    sbuf_init(&d->held, (size_t)1 << 30);
    d->stop_index = -1;
    return 0;
}

void detok_stream_free(detok_stream *d) {
    free(d->scratch);
    sbuf_free(&d->held);
    d->scratch = NULL;
}

/* Earliest stop-string occurrence in held text: its offset, or -1. */
static long detok_find_stop(const detok_stream *d, int *which) {
    long best = -1;
    for (int i = 0; i < d->n_stops; i++) {
        const char *hit = memmem(d->held.data, d->held.len, d->stops[i], strlen(d->stops[i]));
        if (!hit) continue;
        long off = hit - d->held.data;
        if (best < 0 || off < best) {
            best = off;
            *which = i;
        }
    }
    return best;
}

int detok_stream_push_text(detok_stream *d, const char *text, size_t n, sbuf *out) {
    if (d->stop_index >= 0) return 1;
    int rc;
    if (d->n_stops == 0 || d->stops_off) return sbuf_append(out, text, n);
    if ((rc = sbuf_append(&d->held, text, n))) return rc;
    int which = -1;
    long at = detok_find_stop(d, &which);
    if (at >= 0) {
        size_t keep = (size_t)at + (d->include_stop ? strlen(d->stops[which]) : 0);
        if ((rc = sbuf_append(out, d->held.data, keep))) return rc;
        sbuf_reset(&d->held);
        d->stop_index = which;
        return 1;
    }
    /* hold back what could still start a stop string, on a character boundary */
    if (d->held.len < d->max_stop) return 0;
    size_t release = d->held.len - (d->max_stop - 1);
    while (release > 0 && ((unsigned char)d->held.data[release] & 0xC0) == 0x80)
        release--;
    if (release == 0) return 0;
    if ((rc = sbuf_append(out, d->held.data, release))) return rc;
    sbuf_consume(&d->held, release);
    return 0;
}

void detok_stream_set_stops(detok_stream *d, bool on) {
    d->stops_off = !on;
}

int detok_stream_push_token(detok_stream *d, int32_t id, sbuf *out) {
    if (d->stop_index >= 0) return 1;
    if (!d->tok) return -EINVAL;
    size_t n = 0;
    /* an id the model can emit but the tokenizer lacks (the padded tail of the embedding:
     * 151665..151935 for Qwen2.5) decodes to nothing, as in Hugging Face tokenizers and vLLM */
    if (id >= 0 && !tokenizer_token_bytes(d->tok, id, &n)) return 0;
    int rc = tokenizer_stream_push(d->tok, &d->ts, id, d->scratch, d->scratch_cap, &n);
    if (rc) return rc;
    return detok_stream_push_text(d, d->scratch, n, out);
}

int detok_stream_finish(detok_stream *d, sbuf *out) {
    if (d->stop_index >= 0) return 1;
    if (d->tok) {
        size_t n = 0;
        int rc = tokenizer_stream_flush(&d->ts, d->scratch, d->scratch_cap, &n);
        if (rc) return rc;
        rc = detok_stream_push_text(d, d->scratch, n, out);
        if (rc) return rc;
    }
    int rc = sbuf_append(out, d->held.data ? d->held.data : "", d->held.len);
    sbuf_reset(&d->held);
    return rc;
}
