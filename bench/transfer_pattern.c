/*
 * transfer_pattern — the one byte pattern of the transfer bench (`disagg
 * bench transfer --verify`) and harness (`disagg transfer target|check|demo`)
 * (see transfer_bench.h): byte o of a buffer is byte o % 8 of
 * tb_pattern_word(seed, o / 8).  The target side and the initiator side must
 * agree on it; it is independent of the engine.
 */
#include "bench/transfer_bench.h"

#include <string.h>

uint8_t tb_pattern_byte(uint64_t seed, uint64_t offset) {
    return (uint8_t)(tb_pattern_word(seed, offset >> 3) >> (8 * (offset & 7)));
}

void tb_pattern_fill(void *buf, uint64_t offset, size_t len, uint64_t seed) {
    uint8_t *p = buf;
    size_t i = 0;
    for (; i < len && ((offset + i) & 7); i++)
        p[i] = tb_pattern_byte(seed, offset + i);
    for (; i + 8 <= len; i += 8) {
        uint64_t w = tb_pattern_word(seed, (offset + i) >> 3); /* little-endian host */
        memcpy(p + i, &w, 8);
    }
    for (; i < len; i++)
        p[i] = tb_pattern_byte(seed, offset + i);
}

size_t tb_pattern_check(const void *buf, uint64_t offset, size_t len, uint64_t seed,
                        size_t *first) {
    const uint8_t *p = buf;
    size_t bad = 0, first_bad = len, i = 0;
    for (; i < len && ((offset + i) & 7); i++)
        if (p[i] != tb_pattern_byte(seed, offset + i)) {
            if (!bad++) first_bad = i;
        }
    for (; i + 8 <= len; i += 8) {
        uint64_t w, want = tb_pattern_word(seed, (offset + i) >> 3);
        memcpy(&w, p + i, 8);
        if (w == want) continue;
        for (size_t b = 0; b < 8; b++)
            if ((uint8_t)(w >> (8 * b)) != (uint8_t)(want >> (8 * b))) {
                if (!bad++) first_bad = i + b;
            }
    }
    for (; i < len; i++)
        if (p[i] != tb_pattern_byte(seed, offset + i)) {
            if (!bad++) first_bad = i;
        }
    if (first) *first = first_bad;
    return bad;
}
