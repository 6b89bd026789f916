/*
 * tokenizer — Hugging Face `tokenizer.json` BPE (Qwen2/2.5/3, Llama 3, Mistral's
 * SentencePiece BPE and Tekken as the hub ships them) plus the parts of
 * `tokenizer_config.json` the server needs (eos, pad, bos tokens,
 * model_max_length, chat_template text).
 *
 * Encoding follows Hugging Face `tokenizers` step by step, and must agree with
 * it id for id (tests/unit/test_tokenizer.c checks thousands of Qwen strings
 * whose ids HF produced, see tools/gen_tokenizer_golden.py;
 * tests/integration/test_tokenizer_families.py the other families against HF
 * and the original tiktoken / sentencepiece implementations):
 *   1. added tokens whose `normalized` flag is false are split out of the raw
 *      text first (leftmost-longest match, honouring single_word, lstrip,
 *      rstrip); each remaining piece is normalized (NFC/NFD/NFKC/NFKD via
 *      utf8proc, Prepend, Replace with a string or regex, Strip), then added
 *      tokens with `normalized` true are split out of it;
 *   2. pre-tokenizers: Split (Oniguruma regex, behavior Isolated; the Qwen2
 *      and Llama 3 patterns have an ASCII fast path whose character classes
 *      come from Oniguruma), ByteLevel (optional GPT-2 regex and prefix
 *      space) and Metaspace (' ' -> U+2581, prepend_scheme always / first /
 *      never, optional split);
 *   3. BPE with merge ranks (lowest rank first, leftmost on ties) over bytes
 *      (byte-level files) or characters (SentencePiece files: byte_fallback
 *      to <0xXX> tokens, unk_token with fuse_unk), ignore_merges, with a
 *      cache of recently seen words;
 *   4. with add_special, the post-processor's TemplateProcessing ids around
 *      the text (else tokenizer_config.json's add_bos_token/add_eos_token).
 * Decoding follows the decoder: ByteLevel (ids -> bytes), or Replace +
 * ByteFallback + Fuse + Strip / Metaspace (U+2581 -> ' ', a run of <0xXX>
 * tokens that is not UTF-8 becomes one U+FFFD per token, the first leading
 * space of the text is stripped); invalid UTF-8 is replaced as Rust's
 * String::from_utf8_lossy does (one U+FFFD per maximal invalid subpart).
 *
 * Not supported (load fails with a message naming the field): models other
 * than BPE, other normalizers, pre-tokenizers, decoders and post-processors,
 * TemplateProcessing with more than $A (pairs are never encoded here).
 *
 * A loaded tokenizer is read-only and may be shared by threads (the word
 * cache has its own lock).  Functions return 0 or a negative errno; errors
 * write a message into the caller's err buffer (may be NULL) naming the file
 * or the bad value.
 */
#ifndef DISAGG_MODEL_TOKENIZER_H
#define DISAGG_MODEL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tokenizer tokenizer;

/* Load DIR/tokenizer.json and DIR/tokenizer_config.json (the latter is
 * optional: without it there is no chat template and no eos/pad).  On error
 * *out is NULL and err says which file and what is wrong. */
int tokenizer_load(const char *dir, tokenizer **out, char *err, size_t err_cap);
void tokenizer_free(tokenizer *tok);

/* Encode len bytes of UTF-8 text.  add_special adds the bos/eos tokens that
 * tokenizer_config.json asks for (add_bos_token / add_eos_token; Qwen2.5 adds
 * none).  *ids_out is malloc'ed (caller frees), *n_out its length.  Invalid
 * UTF-8 is rejected with -EILSEQ and a message naming the byte offset. */
int tokenizer_encode(const tokenizer *tok, const char *text, size_t len, bool add_special,
                     int32_t **ids_out, size_t *n_out, char *err, size_t err_cap);

/* Encode text with no added token recognised in it: "[INST]" in the text is
 * the characters, never the control token (mistral-common's encode of a
 * message's text, which treats special-token text as text).  No bos/eos. */
int tokenizer_encode_plain(const tokenizer *tok, const char *text, size_t len, int32_t **ids_out,
                           size_t *n_out, char *err, size_t err_cap);

/* Decode ids to UTF-8 text (NUL-terminated, malloc'ed, *len_out without the
 * NUL).  skip_special drops added tokens marked special.  An id outside the
 * vocabulary is -EINVAL. */
int tokenizer_decode(const tokenizer *tok, const int32_t *ids, size_t n, bool skip_special,
                     char **text_out, size_t *len_out, char *err, size_t err_cap);

/* Id of a token given as its vocabulary string (added token content such as
 * "<|im_end|>", or a byte-level vocab key such as "Ġhello"); -1 if none. */
int32_t tokenizer_token_id(const tokenizer *tok, const char *token);
/* The id's vocabulary string (not NUL-terminated) as convert_ids_to_tokens
 * gives it ("Ġhello", "▁hello", "<0x0A>", "<|eot_id|>"); NULL if out of range. */
const char *tokenizer_token_str(const tokenizer *tok, int32_t id, size_t *len);
/* The raw bytes an id decodes to (not NUL-terminated); NULL if out of range. */
const uint8_t *tokenizer_token_bytes(const tokenizer *tok, int32_t id, size_t *len);
/* True if id is an added token marked special. */
bool tokenizer_is_special(const tokenizer *tok, int32_t id);
/* One more than the largest id (vocab plus added tokens). */
int32_t tokenizer_vocab_size(const tokenizer *tok);
/* Longest token in bytes (bounds the stream decoder's output, see below). */
size_t tokenizer_max_token_bytes(const tokenizer *tok);

/* From tokenizer_config.json: ids of eos/pad/bos (-1 when absent), their text
 * (NULL when absent), model_max_length (0 when absent or not an integer) and
 * the chat template text (NULL when absent). */
int32_t tokenizer_eos_id(const tokenizer *tok);
int32_t tokenizer_pad_id(const tokenizer *tok);
int32_t tokenizer_bos_id(const tokenizer *tok);
const char *tokenizer_eos_token(const tokenizer *tok);
uint64_t tokenizer_model_max_length(const tokenizer *tok);
const char *tokenizer_chat_template(const tokenizer *tok);

/* ---- streaming decode --------------------------------------------------
 * Feed ids one at a time; each push writes the text that is complete so far.
 * Bytes of an unfinished UTF-8 character are held until the next push; an
 * invalid sequence becomes U+FFFD as Rust's from_utf8_lossy does.  The
 * concatenation of all pushes plus the flush equals tokenizer_decode of the
 * same ids, except for SentencePiece decoders: the stream decodes a
 * continuation (as vLLM's incremental detokenizer, which has the prompt
 * before it), so it keeps the leading space that decode's Strip removes, and
 * an invalid run of <0xXX> tokens follows the lossy rule rather than one
 * U+FFFD per token. */
typedef struct tokenizer_stream {
    uint8_t pending[4]; /* bytes of an incomplete character */
    int n_pending;      /* how many of pending[] are used */
    bool skip_special;  /* drop special added tokens */
} tokenizer_stream;

/* Output capacity that always suffices for one push or flush. */
#define TOKENIZER_STREAM_OUT_CAP(tok) (3 * (tokenizer_max_token_bytes(tok) + 4) + 1)

void tokenizer_stream_init(tokenizer_stream *st, bool skip_special);
/* Writes up to cap bytes to out (not NUL-terminated), *out_len how many;
 * -ENOSPC when cap < TOKENIZER_STREAM_OUT_CAP, -EINVAL for a bad id. */
int tokenizer_stream_push(const tokenizer *tok, tokenizer_stream *st, int32_t id, char *out,
                          size_t cap, size_t *out_len);
/* End of stream: held bytes of an unfinished character become U+FFFD. */
int tokenizer_stream_flush(tokenizer_stream *st, char *out, size_t cap, size_t *out_len);

/* Validate UTF-8 (the rules of Rust's str: no overlongs, surrogates or values
 * above U+10FFFF).  Returns the byte offset of the first invalid sequence, or
 * len when the text is valid. */
size_t tokenizer_utf8_check(const char *text, size_t len);

#endif
