/*
 * fuzz_segment_desc — what a transfer engine learns from a peer: the segment
 * descriptor JSON (handshake reply, PROTOCOL.md §5) and the 9-byte handshake
 * frame header in front of it.  The first 9 bytes are decoded as a header;
 * the whole input (and the part after the header) as a descriptor.  An
 * accepted descriptor is re-encoded and decoded again; the two encodings
 * must be equal (but for the timestamp, which is the encoding time), and its buffers must satisfy
 * the registry's invariants (sorted, disjoint, non-empty, no wrap-around).
 */
#include "fuzz/fuzz_util.h"

#include "transfer/handshake.h"
#include "transfer/segment_desc.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    return 0;
}

static void check_buffers(const registry *r) {
    for (size_t i = 0; i < r->n; i++) {
        const registry_entry *e = &r->v[i];
        if (e->length == 0 || e->addr + e->length < e->addr) abort();
        if (i > 0 && r->v[i - 1].addr + r->v[i - 1].length > e->addr) abort();
        if (!memchr(e->location, 0, sizeof e->location)) abort();
        if (registry_find(r, e->addr, e->length) != e) abort();
    }
}

/* Equal JSON except "timestamp", which the encoder sets to the current time. */
static int same_but_timestamp(const char *a, const char *b) {
    json_t *x = json_loads(a, 0, NULL), *y = json_loads(b, 0, NULL);
    json_object_del(x, "timestamp");
    json_object_del(y, "timestamp");
    int eq = x && y && json_equal(x, y);
    json_decref(x);
    json_decref(y);
    return eq;
}

static void desc_round_trip(const char *json, size_t len) {
    segment_desc d;
    char err[256];
    segment_desc_init(&d);
    if (segment_desc_decode(json, len, &d, err, sizeof err) != 0) {
        if (!err[0]) abort();
        segment_desc_free(&d);
        return;
    }
    check_buffers(&d.buffers);
    if (d.num_data_addrs > SEGMENT_MAX_DATA_ADDRS) abort();
    char *e1 = segment_desc_encode(&d);
    if (!e1) abort();
    segment_desc d2;
    segment_desc_init(&d2);
    if (segment_desc_decode(e1, strlen(e1), &d2, err, sizeof err) != 0) {
        fprintf(stderr, "segment_desc: own encoding refused: %s\n%s\n", err, e1);
        abort();
    }
    char *e2 = segment_desc_encode(&d2);
    if (!e2 || !same_but_timestamp(e1, e2)) {
        fprintf(stderr, "segment_desc: re-encoding differs\n%s\n%s\n", e1, e2 ? e2 : "(null)");
        abort();
    }
    free(e1);
    free(e2);
    segment_desc_free(&d2);
    segment_desc_free(&d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size >= HANDSHAKE_HEADER_LEN) {
        uint64_t len;
        uint8_t type;
        int rc = handshake_header_decode(data, &len, &type);
        uint64_t raw = 0; /* the length field: counts the type byte (Mooncake) */
        for (int i = 0; i < 8; i++)
            raw |= (uint64_t)data[i] << (8 * i);
        if ((rc == 0) != (raw >= 1 && raw <= HANDSHAKE_MAX_FRAME)) abort();
        if (rc == 0 && type == HANDSHAKE_TYPE_OLD) {
            if (data[8] <= HANDSHAKE_TYPE_PROBE || len != raw) abort(); /* untyped: all body */
        } else if (rc == 0) {
            uint8_t again[HANDSHAKE_HEADER_LEN];
            handshake_header_encode(again, len, type);
            if (len != raw - 1 || memcmp(again, data, HANDSHAKE_HEADER_LEN) != 0) abort();
        }
        desc_round_trip((const char *)data + HANDSHAKE_HEADER_LEN, size - HANDSHAKE_HEADER_LEN);
    }
    desc_round_trip((const char *)data, size);
    return 0;
}
