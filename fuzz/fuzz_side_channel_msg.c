/*
 * fuzz_side_channel_msg — the MessagePack side-channel messages (PROTOCOL.md
 * §3) a prefill instance receives from any decode instance (pull requests)
 * and a decode instance receives from a prefill (replies).  Every input goes
 * through both decoders.  When one accepts it, the message is re-encoded and
 * decoded again: the second encoding must equal the first byte for byte (the
 * decoder keeps everything the encoder writes, and the encoder writes only
 * what the decoder accepts).
 */
#include "fuzz/fuzz_util.h"

#include "connector/mooncake/side_channel_msg.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

static void check_same(const char *what, const char *a, size_t alen, const char *b, size_t blen) {
    if (alen != blen || memcmp(a, b, alen) != 0) {
        fprintf(stderr, "%s: re-encoding differs (%zu vs %zu bytes)\n", what, alen, blen);
        abort();
    }
}

static void pull_round_trip(const uint8_t *data, size_t size) {
    side_channel_pull p;
    char err[256];
    if (side_channel_pull_decode(data, size, &p, err, sizeof err) != 0) return;
    char *e1 = NULL, *e2 = NULL;
    size_t l1 = 0, l2 = 0;
    if (side_channel_pull_encode(&p, &e1, &l1) != 0) {
        fprintf(stderr, "pull: decoded but cannot re-encode\n");
        abort();
    }
    side_channel_pull q;
    if (side_channel_pull_decode(e1, l1, &q, err, sizeof err) != 0) {
        fprintf(stderr, "pull: own encoding refused: %s\n", err);
        abort();
    }
    if (side_channel_pull_encode(&q, &e2, &l2) != 0) abort();
    check_same("pull", e1, l1, e2, l2);
    free(e1);
    free(e2);
    side_channel_pull_free(&q);
    side_channel_pull_free(&p);
}

static void reply_round_trip(const uint8_t *data, size_t size) {
    side_channel_reply r;
    char err[256];
    if (side_channel_reply_decode(data, size, &r, err, sizeof err) != 0) return;
    (void)side_channel_status_name(r.status);
    char *e1 = NULL, *e2 = NULL;
    size_t l1 = 0, l2 = 0;
    if (side_channel_reply_encode(&r, &e1, &l1) != 0) {
        fprintf(stderr, "reply: decoded but cannot re-encode\n");
        abort();
    }
    side_channel_reply q;
    if (side_channel_reply_decode(e1, l1, &q, err, sizeof err) != 0) {
        fprintf(stderr, "reply: own encoding refused: %s\n", err);
        abort();
    }
    if (side_channel_reply_encode(&q, &e2, &l2) != 0) abort();
    check_same("reply", e1, l1, e2, l2);
    free(e1);
    free(e2);
    side_channel_reply_free(&q);
    side_channel_reply_free(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    pull_round_trip(data, size);
    reply_round_trip(data, size);
    return 0;
}
