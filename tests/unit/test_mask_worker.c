/*
 * test_mask_worker — a step's grammar bitmasks filled on the mask threads (overlapped, 1 and
 * 3 threads) equal the ones filled on the caller's thread (serial) and the reference: the
 * state's mask plus the model's eos and the request's stop ids exactly where the grammar
 * accepts.  Rows of one shared grammar and of grammars of their own, 40 rows a step (past
 * the first allocation), random walks that reach accepting and terminated states, steps with
 * no rows, and work done on the caller's thread between start and join (the forward's place);
 * mask_worker_run (the same threads' per-row jobs between steps) runs every item once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/mask_worker.h"
#include "grammar/grammar.h"

#define N_ROWS 40

static grammar_vocab *vocab;
static int n_vocab;
static int32_t eos_id;

/* All 256 single bytes, some JSON-ish pieces, an eos (special) at the end. */
static int setup(void **state) {
    (void)state;
    static const char *pieces[] = {"{\"",  "\":", "\": ", "\",",  "\"}", "true", "false",
                                   "null", "  ",  "12",   "-1",   "ab",  "abc",  "\"x\"",
                                   "yes",  "no",  "@",    ".com", "00",  "120"};
    static uint8_t bytes1[256];
    const uint8_t *bytes[300];
    size_t lens[300];
    uint8_t special[300] = {0};
    int n = 0;
    for (int b = 0; b < 256; b++) {
        bytes1[b] = (uint8_t)b;
        bytes[n] = &bytes1[b];
        lens[n++] = 1;
    }
    for (size_t i = 0; i < sizeof pieces / sizeof pieces[0]; i++) {
        bytes[n] = (const uint8_t *)pieces[i];
        lens[n++] = strlen(pieces[i]);
    }
    eos_id = n;
    bytes[n] = (const uint8_t *)"<eos>", lens[n] = 5, special[n++] = 1;
    n_vocab = n;
    vocab = grammar_vocab_new(n_vocab, bytes, lens, special);
    return vocab ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    grammar_vocab_free(vocab);
    return 0;
}

static grammar *compile(grammar_kind k, const char *text) {
    char err[256];
    grammar_options opt = {.any_whitespace = 0};
    grammar *g = grammar_compile(k, text, strlen(text), &opt, vocab, err, sizeof err);
    if (!g) fail_msg("compile %s: %s", text, err);
    return g;
}

/* The reference bitmask of (g, s) with stop ids. */
static void reference(grammar *g, grammar_state s, const int32_t *stop, int n_stop, uint32_t *out) {
    int words = (n_vocab + 31) / 32;
    memcpy(out, grammar_state_mask(g, s), (size_t)words * sizeof *out);
    if (!grammar_state_accepting(g, s)) return;
    out[eos_id >> 5] |= 1u << (eos_id & 31);
    for (int k = 0; k < n_stop; k++)
        out[stop[k] >> 5] |= 1u << (stop[k] & 31);
}

/* mask_worker_run's item: squares[i] = i * i + 1. */
static void square(void *ctx, int i) {
    ((int *)ctx)[i] = i * i + 1;
}

static unsigned rnd(unsigned *x) {
    *x = *x * 1103515245u + 12345u;
    return *x >> 16;
}

/* Walks N_ROWS rows for 30 steps in mode (0 serial, else overlapped with that many threads). */
static void walk(int threads, int own_grammars) {
    static const char *schema = "{\"type\": \"object\", \"properties\": {\"a\": {\"type\": "
                                "\"integer\", \"minimum\": 0, \"maximum\": 120}, \"b\": {\"enum\": "
                                "[\"yes\", \"no\"]}}, \"required\": [\"a\", \"b\"]}";
    grammar *shared = compile(GRAMMAR_JSON_SCHEMA, schema);
    grammar *g[N_ROWS];
    grammar_state s[N_ROWS];
    int32_t stop[N_ROWS][1];
    for (int i = 0; i < N_ROWS; i++) {
        g[i] = own_grammars ? (i % 2 ? compile(GRAMMAR_JSON_SCHEMA, schema)
                                     : compile(GRAMMAR_REGEX, "[a-c]{1,4}@(x|yes)\\.com"))
                            : grammar_ref(shared);
        s[i] = grammar_start(g[i]);
        stop[i][0] = 200 + i; /* a byte token, as a request's stop id */
    }
    int32_t eos = eos_id;
    mask_worker *w = mask_worker_new(n_vocab, &eos, 1, threads ? threads : 1);
    assert_non_null(w);
    int words = (n_vocab + 31) / 32;
    uint32_t *ref = malloc((size_t)words * sizeof *ref);
    uint32_t *ext = malloc((size_t)N_ROWS * words * sizeof *ext);
    assert_non_null(ext);
    unsigned x = 7u + (unsigned)threads;
    for (int step = 0; step < 30; step++) {
        mask_worker_reset(w);
        uint32_t *rows[N_ROWS];
        int idx[N_ROWS], n = 0;
        for (int i = 0; i < N_ROWS; i++) {
            if (step % 7 == 3 && i % 2) continue; /* some steps leave rows out */
            if (step == 5) continue;              /* and one has none */
            /* every third row into the caller's memory (the engine's page-locked rows) */
            uint32_t *dst = i % 3 == 0 ? ext + (size_t)n * words : NULL;
            rows[n] = mask_worker_add(w, g[i], s[i], stop[i], 1, dst);
            assert_non_null(rows[n]);
            if (dst) assert_ptr_equal(rows[n], dst);
            idx[n++] = i;
        }
        mask_worker_start(w, threads > 0);
        volatile double busy = 0; /* the forward's place */
        for (int k = 0; k < 20000; k++)
            busy += k * 0.5;
        mask_worker_join(w);
        int nr;
        uint64_t fill, wait;
        mask_worker_last(w, &nr, &fill, &wait);
        assert_int_equal(nr, n);
        /* the threads' other job between a join and the next start (the engine's draws) */
        int squares[N_ROWS + 1];
        memset(squares, 0, sizeof squares);
        mask_worker_run(w, n, square, squares);
        for (int r = 0; r <= N_ROWS; r++)
            assert_int_equal(squares[r], r < n ? r * r + 1 : 0);
        for (int r = 0; r < n; r++) {
            int i = idx[r];
            reference(g[i], s[i], stop[i], 1, ref);
            assert_memory_equal(rows[r], ref, (size_t)words * sizeof *ref);
            /* advance by a random allowed token (or restart at a terminated state) */
            int allowed[400], na = 0;
            for (int t = 0; t < n_vocab; t++)
                if (rows[r][t >> 5] >> (t & 31) & 1u) allowed[na++] = t;
            int32_t t = na ? allowed[rnd(&x) % (unsigned)na] : eos_id;
            if (t == eos_id || t == stop[i][0] || grammar_state_terminated(g[i], s[i]))
                s[i] = grammar_start(g[i]);
            else
                s[i] = grammar_advance_token(g[i], s[i], t);
            assert_int_not_equal(s[i], GRAMMAR_DEAD);
        }
    }
    free(ref);
    free(ext);
    mask_worker_free(w);
    for (int i = 0; i < N_ROWS; i++)
        grammar_unref(g[i]);
    grammar_unref(shared);
}

static void test_serial(void **state) {
    (void)state;
    walk(0, 0);
    walk(0, 1);
}

static void test_overlap_one_thread(void **state) {
    (void)state;
    walk(1, 0);
    walk(1, 1);
}

static void test_overlap_three_threads(void **state) {
    (void)state;
    walk(3, 0);
    walk(3, 1);
}

static void test_free_unused(void **state) {
    (void)state;
    int32_t eos = eos_id;
    mask_worker *w = mask_worker_new(n_vocab, &eos, 1, 2); /* threads never started */
    assert_non_null(w);
    mask_worker_reset(w);
    mask_worker_start(w, 1); /* no rows: nothing to do */
    mask_worker_join(w);
    mask_worker_free(w);
    mask_worker_free(NULL);
}

static void test_run(void **state) {
    (void)state;
    int32_t eos = eos_id;
    mask_worker *w = mask_worker_new(n_vocab, &eos, 1, 3);
    assert_non_null(w);
    static int out[1000];
    for (int rep = 0; rep < 50; rep++) {
        int n = rep == 0 ? 0 : rep == 1 ? 1 : rep * 20;
        memset(out, 0, sizeof out);
        mask_worker_run(w, n, square, out);
        for (int i = 0; i < 1000; i++)
            assert_int_equal(out[i], i < n ? i * i + 1 : 0);
    }
    mask_worker_free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_serial),
        cmocka_unit_test(test_overlap_one_thread),
        cmocka_unit_test(test_overlap_three_threads),
        cmocka_unit_test(test_free_unused),
        cmocka_unit_test(test_run),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
