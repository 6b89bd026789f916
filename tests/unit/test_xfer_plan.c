/* Unit tests: xfer_plan — tail pairing, coalescing and checks, against
 * addresses worked out by hand from PROTOCOL.md §3 ("block address = base +
 * block_id x block_len", "P sends the TAIL of its blocks", "contiguous block
 * runs are coalesced"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "connector/mooncake/xfer_plan.h"

#include <stdlib.h>
#include <string.h>

static void test_tail_and_coalescing(void **state) {
    (void)state;
    /* P holds blocks 10 11 12 20 21; D had a prefix hit and asks for 3 blocks
     * 5 6 9: pairs 12->5, 20->6, 21->9; 12,20 is not contiguous on P; 20,21 is,
     * but 6,9 is not on D: three runs of one block */
    int64_t p[] = {10, 11, 12, 20, 21}, d[] = {5, 6, 9};
    xfer_region pr = {0x100000, 0x1000, 0x1000}, dr = {0x900000, 0x1000, 0x1000};
    xfer_run runs[8];
    char err[256];
    int n = xfer_plan_request(p, 5, d, 3, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 3);
    assert_true(runs[0].src == 0x100000 + 12 * 0x1000 && runs[0].dst == 0x900000 + 5 * 0x1000);
    assert_true(runs[0].len == 0x1000);
    assert_true(runs[1].src == 0x100000 + 20 * 0x1000 && runs[1].dst == 0x900000 + 6 * 0x1000);
    assert_true(runs[2].src == 0x100000 + 21 * 0x1000 && runs[2].dst == 0x900000 + 9 * 0x1000);
    /* both sides contiguous: one descriptor for 4 blocks */
    int64_t p2[] = {3, 4, 5, 6}, d2[] = {40, 41, 42, 43};
    n = xfer_plan_request(p2, 4, d2, 4, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 1);
    assert_true(runs[0].src == 0x100000 + 3 * 0x1000 && runs[0].dst == 0x900000 + 40 * 0x1000);
    assert_true(runs[0].len == 4 * 0x1000);
    /* a run break in the middle */
    int64_t p3[] = {3, 4, 5, 6}, d3[] = {40, 41, 50, 51};
    n = xfer_plan_request(p3, 4, d3, 4, &pr, &dr, 1, 64, runs, 8, err, sizeof err);
    assert_int_equal(n, 2);
    assert_true(runs[0].len == 2 * 0x1000 && runs[1].len == 2 * 0x1000);
    assert_true(runs[1].src == 0x100000 + 5 * 0x1000 && runs[1].dst == 0x900000 + 50 * 0x1000);
    /* a release */
    assert_int_equal(xfer_plan_request(p3, 4, NULL, 0, &pr, &dr, 1, 64, runs, 8, err, sizeof err),
                     0);
}

static void test_sparse_blocks_and_two_regions(void **state) {
    (void)state;
    /* payload 0x800 in a 0x1000 stride (P) and 0x2000 stride (D): never coalesced */
    xfer_region pr[2] = {{0x10000, 0x1000, 0x800}, {0x80000, 0x400, 0x400}};
    xfer_region dr[2] = {{0x200000, 0x2000, 0x800}, {0x300000, 0x400, 0x400}};
    int64_t p[] = {1, 2}, d[] = {7, 8};
    xfer_run runs[8];
    char err[256];
    int n = xfer_plan_request(p, 2, d, 2, pr, dr, 2, 16, runs, 8, err, sizeof err);
    assert_int_equal(n, 3);
    assert_true(runs[0].src == 0x10000 + 0x1000 && runs[0].dst == 0x200000 + 7 * 0x2000);
    assert_true(runs[0].len == 0x800);
    assert_true(runs[1].src == 0x10000 + 2 * 0x1000 && runs[1].dst == 0x200000 + 8 * 0x2000);
    /* region 1 is dense: one run */
    assert_true(runs[2].src == 0x80000 + 0x400 && runs[2].dst == 0x300000 + 7 * 0x400);
    assert_true(runs[2].len == 0x800);
}

static void test_errors(void **state) {
    (void)state;
    xfer_region pr = {0x1000, 0x100, 0x100}, dr = {0x2000, 0x100, 0x100};
    xfer_run runs[2];
    char err[256];
    int64_t p[] = {1}, d[] = {1, 2};
    assert_int_equal(xfer_plan_request(p, 1, d, 2, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_ETOOFEW);
    assert_non_null(strstr(err, "asked for 2 blocks but the prefill side holds 1"));
    xfer_region bad = {0x2000, 0x100, 0x80};
    int64_t p1[] = {1}, d1[] = {1};
    assert_int_equal(xfer_plan_request(p1, 1, d1, 1, &pr, &bad, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "does not match"));
    int64_t pbig[] = {8}, dneg[] = {-1};
    assert_int_equal(xfer_plan_request(pbig, 1, d1, 1, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_int_equal(xfer_plan_request(p1, 1, dneg, 1, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "out of range"));
    xfer_region huge = {UINT64_MAX - 0x10, 0x100, 0x100};
    assert_int_equal(xfer_plan_request(p1, 1, d1, 1, &pr, &huge, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "overflows"));
    int64_t p3[] = {1, 3, 5}, d3[] = {1, 3, 5};
    assert_int_equal(xfer_plan_request(p3, 3, d3, 3, &pr, &dr, 1, 8, runs, 2, err, sizeof err),
                     XFER_PLAN_ENOSPC);
}

/* ---- tensor parallelism ----------------------------------------------------------------
 * The reference is independent of the plan: build the unsharded KV of every P block
 * (element bytes from a hash of block, layer, K/V, slot, head, byte), shard it into each P
 * rank's region by the head split vLLM documents (written here from its definition, not
 * with xfer_tp_heads), run each D rank's pulls by copying the planned rows with memcpy
 * (counting how often every D byte is written), then unshard each D rank and compare with
 * the unsharded KV of the P blocks it asked for.  Every target byte written exactly once,
 * every other byte of D untouched. */

static uint8_t kv_byte(int64_t blk, int l, int w, int s, int h, int byte) {
    uint64_t x =
        ((((((uint64_t)blk * 131u + (uint64_t)l) * 7u + (uint64_t)w) * 257u + (uint64_t)s) * 61u +
          (uint64_t)h) *
         4099u) +
        (uint64_t)byte;
    x ^= x >> 17;
    x *= 0x9E3779B97F4A7C15ull;
    return (uint8_t)(x >> 56);
}

/* vLLM's QKVParallelLinear: tp <= H splits H / tp heads per rank; tp > H replicates,
 * tp / H ranks per head. */
static void ref_heads(int tp, int rank, int H, int *h0, int *n) {
    if (tp <= H) {
        *n = H / tp;
        *h0 = rank * (H / tp);
    } else {
        *n = 1;
        *h0 = rank / (tp / H);
    }
}

typedef struct tp_case {
    int p_tp, d_tp, H;
    int sparse; /* 1: D's block stride is larger than its payload */
} tp_case;

static void run_tp_case_ids(const tp_case *tc, const int64_t *p_ids, size_t n_p,
                            const int64_t *d_ids, size_t n_d) {
    const xfer_kv_shape sh = {
        .n_layers = 3, .block_size = 4, .n_kv_heads = tc->H, .head_dim = 4, .elem_bytes = 2};
    const int rows = sh.n_layers * 2 * sh.block_size, hb = sh.head_dim * sh.elem_bytes;
    const int p_blocks = 10, d_blocks = 12;
    uint8_t *p_buf[16], *d_buf[16];
    uint8_t *d_hits[16];
    uint64_t p_bl[16], d_bl[16];
    for (int r = 0; r < tc->p_tp; r++) {
        int h0, n;
        ref_heads(tc->p_tp, r, tc->H, &h0, &n);
        p_bl[r] = (uint64_t)rows * (uint64_t)(n * hb);
        p_buf[r] = malloc(p_bl[r] * (uint64_t)p_blocks);
        assert_non_null(p_buf[r]);
        for (int b = 0; b < p_blocks; b++)
            for (int row = 0; row < rows; row++)
                for (int j = 0; j < n; j++)
                    for (int x = 0; x < hb; x++) {
                        int l = row / (2 * sh.block_size), w = (row / sh.block_size) % 2,
                            s = row % sh.block_size;
                        p_buf[r][(uint64_t)b * p_bl[r] + (uint64_t)row * (uint64_t)(n * hb) +
                                 (uint64_t)(j * hb + x)] = kv_byte(b, l, w, s, h0 + j, x);
                    }
    }
    for (int r = 0; r < tc->d_tp; r++) {
        int h0, n;
        ref_heads(tc->d_tp, r, tc->H, &h0, &n);
        d_bl[r] = (uint64_t)rows * (uint64_t)(n * hb) + (tc->sparse ? 24u : 0u);
        d_buf[r] = malloc(d_bl[r] * (uint64_t)d_blocks);
        d_hits[r] = calloc(d_bl[r] * (uint64_t)d_blocks, 1);
        assert_non_null(d_buf[r]);
        assert_non_null(d_hits[r]);
        memset(d_buf[r], 0xEE, d_bl[r] * (uint64_t)d_blocks);
    }
    char err[256] = "";
    assert_int_equal(xfer_tp_check(tc->p_tp, tc->d_tp, tc->H, err, sizeof err), 0);
    for (int dr = 0; dr < tc->d_tp; dr++) {
        int peers[16];
        int np = xfer_tp_peers(tc->p_tp, tc->d_tp, dr, peers, 16);
        assert_true(np >= 1);
        for (int k = 0; k < np; k++) {
            int pr = peers[k];
            xfer_tp_side ps = {tc->p_tp, pr, (uint64_t)(uintptr_t)p_buf[pr], p_bl[pr]};
            xfer_tp_side ds = {tc->d_tp, dr, (uint64_t)(uintptr_t)d_buf[dr], d_bl[dr]};
            xfer_run2d runs[64];
            int n = xfer_plan_tp_request(p_ids, n_p, d_ids, n_d, &sh, &ps, &ds, (uint64_t)p_blocks,
                                         runs, 64, err, sizeof err);
            if (n < 0) fail_msg("P %d -> D %d: %s", pr, dr, err);
            /* the flat form moves the same bytes: copy through it */
            xfer_run flat[4096];
            int nf = xfer_run2d_flatten(runs, (size_t)n, flat, 4096, err, sizeof err);
            assert_true(nf >= n);
            for (int i = 0; i < nf; i++) {
                uint64_t off = flat[i].dst - (uint64_t)(uintptr_t)d_buf[dr];
                assert_true(flat[i].src >= (uint64_t)(uintptr_t)p_buf[pr]);
                assert_true(flat[i].src + flat[i].len <=
                            (uint64_t)(uintptr_t)p_buf[pr] + p_bl[pr] * (uint64_t)p_blocks);
                assert_true(off + flat[i].len <= d_bl[dr] * (uint64_t)d_blocks);
                memcpy((void *)(uintptr_t)flat[i].dst, (const void *)(uintptr_t)flat[i].src,
                       flat[i].len);
                for (uint64_t x = 0; x < flat[i].len; x++)
                    d_hits[dr][off + x]++;
            }
        }
    }
    /* unshard D and compare */
    for (int dr = 0; dr < tc->d_tp; dr++) {
        int h0, n;
        ref_heads(tc->d_tp, dr, tc->H, &h0, &n);
        for (int b = 0; b < d_blocks; b++) {
            int64_t src_blk = -1;
            for (size_t i = 0; i < n_d; i++)
                if (d_ids[i] == b) src_blk = p_ids[n_p - n_d + i];
            for (uint64_t y = 0; y < d_bl[dr]; y++) {
                uint64_t at = (uint64_t)b * d_bl[dr] + y;
                uint64_t payload = (uint64_t)rows * (uint64_t)(n * hb);
                if (src_blk < 0 || y >= payload) {
                    if (d_hits[dr][at] != 0 || d_buf[dr][at] != 0xEE)
                        fail_msg("P%d->D%d H%d: D rank %d block %d byte %llu written", tc->p_tp,
                                 tc->d_tp, tc->H, dr, b, (unsigned long long)y);
                    continue;
                }
                int row = (int)(y / (uint64_t)(n * hb)), in = (int)(y % (uint64_t)(n * hb));
                int l = row / (2 * sh.block_size), w = (row / sh.block_size) % 2,
                    s = row % sh.block_size;
                uint8_t want = kv_byte(src_blk, l, w, s, h0 + in / hb, in % hb);
                if (d_hits[dr][at] != 1 || d_buf[dr][at] != want)
                    fail_msg("P%d->D%d H%d: D rank %d block %d byte %llu: written %d times, "
                             "0x%02x, want 0x%02x",
                             tc->p_tp, tc->d_tp, tc->H, dr, b, (unsigned long long)y,
                             d_hits[dr][at], d_buf[dr][at], want);
            }
        }
    }
    for (int r = 0; r < tc->p_tp; r++)
        free(p_buf[r]);
    for (int r = 0; r < tc->d_tp; r++) {
        free(d_buf[r]);
        free(d_hits[r]);
    }
}

static void run_tp_case(const tp_case *tc) {
    /* P holds 6 blocks, D had a 1-block prefix hit and asks for 5 (tail pairing): 9->10,
     * 3->11, 4->1, 5->2 (consecutive on both sides: one run when dense), 0->7 */
    const int64_t p_ids[] = {2, 9, 3, 4, 5, 0}, d_ids[] = {10, 11, 1, 2, 7};
    run_tp_case_ids(tc, p_ids, 6, d_ids, 5);
}

/* vLLM's rules, written independently of xfer_tp_check: each TP size divides the KV heads
 * or is a multiple of them, and the two sizes divide one another. */
static int vllm_accepts(int p_tp, int d_tp, int H) {
    int p_ok = H % p_tp == 0 || p_tp % H == 0, d_ok = H % d_tp == 0 || d_tp % H == 0;
    int ratio_ok = p_tp >= d_tp ? p_tp % d_tp == 0 : d_tp % p_tp == 0;
    return p_ok && d_ok && ratio_ok;
}

/* Random sweep: TP sizes 1..8, KV heads 1..8, random block ids (tail pairing, runs and
 * breaks), dense and strided decoders: accepted exactly when vLLM accepts, and when
 * accepted, byte-exact against the reference. */
static void test_tp_random_sweep(void **state) {
    (void)state;
    uint64_t seed = 0x2545F4914F6CDD1Dull;
#define RND() (seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17, seed)
    int accepted = 0, refused = 0;
    for (int iter = 0; iter < 300; iter++) {
        tp_case tc = {(int)(RND() % 8) + 1, (int)(RND() % 8) + 1, (int)(RND() % 8) + 1,
                      (int)(RND() % 2)};
        char err[256];
        int rc = xfer_tp_check(tc.p_tp, tc.d_tp, tc.H, err, sizeof err);
        if (!vllm_accepts(tc.p_tp, tc.d_tp, tc.H)) {
            if (rc != XFER_PLAN_EINVAL) fail_msg("P%d D%d H%d accepted", tc.p_tp, tc.d_tp, tc.H);
            refused++;
            continue;
        }
        if (rc != 0) fail_msg("P%d D%d H%d refused: %s", tc.p_tp, tc.d_tp, tc.H, err);
        accepted++;
        int64_t pool_p[10], pool_d[12];
        for (int i = 0; i < 10; i++)
            pool_p[i] = i;
        for (int i = 0; i < 12; i++)
            pool_d[i] = i;
        /* shuffle, but sometimes keep runs of consecutive ids */
        if (RND() % 3) {
            for (int i = 9; i > 0; i--) {
                int j = (int)(RND() % (uint64_t)(i + 1));
                int64_t t = pool_p[i];
                pool_p[i] = pool_p[j];
                pool_p[j] = t;
            }
            for (int i = 11; i > 0; i--) {
                int j = (int)(RND() % (uint64_t)(i + 1));
                int64_t t = pool_d[i];
                pool_d[i] = pool_d[j];
                pool_d[j] = t;
            }
        }
        size_t n_p = (size_t)(RND() % 10) + 1, n_d = (size_t)(RND() % n_p) + 1;
        run_tp_case_ids(&tc, pool_p, n_p, pool_d + (RND() % (12 - n_d + 1)), n_d);
    }
#undef RND
    assert_true(accepted > 50 && refused > 50);
}

static void test_tp_against_unsharded_reference(void **state) {
    (void)state;
    static const tp_case cases[] = {
        {1, 1, 4, 0},
        {2, 2, 4, 0},
        {2, 1, 4, 0},
        {1, 2, 4, 0},
        {4, 2, 4, 0},
        {2, 4, 4, 0},
        {4, 1, 4, 0},
        {1, 4, 4, 0},
        {4, 4, 4, 0},
        {2, 1, 4, 1},
        {1, 2, 4, 1},
        {8, 2, 4, 0},
        /* replicated KV heads (TP > KV heads) */
        {4, 1, 2, 0},
        {1, 4, 2, 0},
        {4, 2, 2, 0},
        {2, 4, 2, 0},
        {4, 4, 2, 0},
        {8, 1, 2, 0},
        {2, 1, 1, 0},
        {1, 2, 1, 0},
        {4, 2, 1, 1},
        {2, 8, 1, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        run_tp_case(&cases[i]);
}

/* Exact byte ranges, worked out by hand: 1 layer, block_size 2, 2 KV heads of 4 bf16
 * elements: a block has 4 rows (K slot 0, K slot 1, V slot 0, V slot 1); a full row is
 * 16 bytes, one head 8. */
static void test_tp_exact_ranges(void **state) {
    (void)state;
    const xfer_kv_shape sh = {1, 2, 2, 4, 2};
    int64_t p[] = {3, 4}, d[] = {7, 8};
    xfer_run2d r[4];
    char err[256];
    int peers[4];
    /* P TP 2 -> D TP 1: D rank 0 pulls from P ranks 0 and 1; each writes its head into
     * the left / right half of every D row; both sides' ids consecutive: one 2-D run of
     * 2 blocks x 4 rows */
    assert_int_equal(xfer_tp_peers(2, 1, 0, peers, 4), 2);
    assert_true(peers[0] == 0 && peers[1] == 1);
    assert_int_equal(xfer_tp_consumers(2, 1, 1), 1);
    xfer_tp_side d1 = {1, 0, 0x9000, 64};
    xfer_tp_side p0 = {2, 0, 0x1000, 32}, p1 = {2, 1, 0x2000, 32};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &p0, &d1, 16, r, 4, err, sizeof err), 1);
    assert_true(r[0].src == 0x1000 + 3 * 32 && r[0].dst == 0x9000 + 7 * 64);
    assert_true(r[0].len == 8 && r[0].count == 8 && r[0].src_pitch == 8 && r[0].dst_pitch == 16);
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &p1, &d1, 16, r, 4, err, sizeof err), 1);
    assert_true(r[0].src == 0x2000 + 3 * 32 && r[0].dst == 0x9000 + 7 * 64 + 8);
    assert_true(r[0].len == 8 && r[0].count == 8 && r[0].src_pitch == 8 && r[0].dst_pitch == 16);
    xfer_run flat[16];
    assert_int_equal(xfer_run2d_flatten(r, 1, flat, 16, err, sizeof err), 8);
    assert_true(flat[7].src == 0x2000 + 3 * 32 + 7 * 8 &&
                flat[7].dst == 0x9000 + 7 * 64 + 8 + 7 * 16);
    assert_true(flat[7].len == 8);
    assert_int_equal(xfer_run2d_flatten(r, 1, flat, 7, err, sizeof err), XFER_PLAN_ENOSPC);
    /* P TP 1 -> D TP 2: D rank 1 pulls head 1 from the right half of P's rows */
    assert_int_equal(xfer_tp_peers(1, 2, 1, peers, 4), 1);
    assert_int_equal(peers[0], 0);
    assert_int_equal(xfer_tp_consumers(1, 2, 0), 2);
    xfer_tp_side pf = {1, 0, 0x1000, 64}, dh1 = {2, 1, 0x5000, 32};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &pf, &dh1, 16, r, 4, err, sizeof err),
                     1);
    assert_true(r[0].src == 0x1000 + 3 * 64 + 8 && r[0].dst == 0x5000 + 7 * 32);
    assert_true(r[0].len == 8 && r[0].count == 8 && r[0].src_pitch == 16 && r[0].dst_pitch == 8);
    /* equal TP: whole blocks, coalesced (2 blocks = 128 bytes), flattened to one run */
    xfer_tp_side df = {1, 0, 0x9000, 64};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &pf, &df, 16, r, 4, err, sizeof err), 1);
    assert_true(r[0].src == 0x1000 + 3 * 64 && r[0].dst == 0x9000 + 7 * 64);
    assert_true(r[0].len == 128 && r[0].count == 1);
    assert_int_equal(xfer_run2d_flatten(r, 1, flat, 1, err, sizeof err), 1);
    assert_true(flat[0].len == 128);
    /* not consecutive on D: one run per block, 4 rows each */
    int64_t d2[] = {7, 9};
    assert_int_equal(xfer_plan_tp_request(p, 2, d2, 2, &sh, &p1, &d1, 16, r, 4, err, sizeof err),
                     2);
    assert_true(r[1].src == 0x2000 + 4 * 32 && r[1].dst == 0x9000 + 9 * 64 + 8 && r[1].count == 4);
    /* 4 -> 2 and 2 -> 4 with 4 heads: D rank 1 of 2 pulls from P ranks 2, 3; P rank 1 of 2
     * feeds D ranks 2, 3 */
    assert_int_equal(xfer_tp_peers(4, 2, 1, peers, 4), 2);
    assert_true(peers[0] == 2 && peers[1] == 3);
    assert_int_equal(xfer_tp_peers(2, 4, 3, peers, 4), 1);
    assert_int_equal(peers[0], 1);
    assert_int_equal(xfer_tp_consumers(2, 4, 1), 2);
    /* replicated: 2 heads, P TP 4 (heads 0 0 1 1) -> D TP 1: P ranks 1 and 3 only release */
    xfer_tp_slice s;
    assert_int_equal(xfer_tp_slice_of(4, 1, 1, 0, 2, &s, err, sizeof err), 0);
    assert_int_equal(s.n_heads, 0);
    assert_int_equal(xfer_tp_slice_of(4, 2, 1, 0, 2, &s, err, sizeof err), 0);
    assert_true(s.n_heads == 1 && s.head0 == 1 && s.p_off == 0 && s.d_off == 1);
    xfer_tp_side pr1 = {4, 1, 0x1000, 32};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &pr1, &d1, 16, r, 4, err, sizeof err),
                     0);
    /* a release (D asks for no blocks) plans nothing */
    assert_int_equal(xfer_plan_tp_request(p, 2, NULL, 0, &sh, &p0, &d1, 16, r, 4, err, sizeof err),
                     0);
}

static void test_tp_refusals(void **state) {
    (void)state;
    char err[256];
    /* KV heads not divisible by the TP size, nor the TP size by the heads */
    assert_int_equal(xfer_tp_check(3, 1, 2, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "prefill tensor-parallel size 3 cannot hold 2 KV heads"));
    assert_int_equal(xfer_tp_check(1, 4, 6, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "decode tensor-parallel size 4 cannot hold 6 KV heads"));
    /* sizes that do not divide one another (6 heads: 2 and 3 both hold them) */
    assert_int_equal(xfer_tp_check(2, 3, 6, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "do not divide one another"));
    assert_int_equal(xfer_tp_check(0, 1, 2, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "out of range"));
    assert_int_equal(xfer_tp_check(1, 1, 0, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "0 KV heads"));
    assert_int_equal(xfer_tp_check(2, 4, 8, err, sizeof err), 0);
    assert_int_equal(xfer_tp_check(8, 2, 4, err, sizeof err), 0);
    int peers[2];
    assert_int_equal(xfer_tp_peers(8, 1, 0, peers, 2), XFER_PLAN_ENOSPC);
    assert_int_equal(xfer_tp_peers(2, 2, 2, peers, 2), XFER_PLAN_EINVAL);
    assert_int_equal(xfer_tp_consumers(2, 2, 5), XFER_PLAN_EINVAL);
    /* a P rank not paired with the D rank */
    xfer_tp_slice s;
    assert_int_equal(xfer_tp_slice_of(2, 0, 2, 1, 4, &s, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "prefill tp_rank 0 is not paired with decode tp_rank 1"));
    assert_int_equal(xfer_tp_slice_of(2, 2, 2, 1, 4, &s, err, sizeof err), XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "rank out of range"));
    const xfer_kv_shape sh = {1, 2, 2, 4, 2};
    int64_t p[] = {3, 4}, d[] = {7, 8};
    xfer_run2d r[1];
    xfer_tp_side p0 = {2, 0, 0x1000, 32}, d1 = {1, 0, 0x9000, 64};
    /* region smaller than its heads */
    xfer_tp_side small = {1, 0, 0x9000, 48};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &p0, &small, 16, r, 1, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "decode block_len 48 (needs 64)"));
    /* P holds fewer blocks than D asked for; ids out of range; too many runs; overflow */
    int64_t d3[] = {7, 8, 9};
    assert_int_equal(xfer_plan_tp_request(p, 2, d3, 3, &sh, &p0, &d1, 16, r, 1, err, sizeof err),
                     XFER_PLAN_ETOOFEW);
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &p0, &d1, 4, r, 1, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "out of range"));
    int64_t d4[] = {7, 10};
    assert_int_equal(xfer_plan_tp_request(p, 2, d4, 2, &sh, &p0, &d1, 16, r, 1, err, sizeof err),
                     XFER_PLAN_ENOSPC);
    xfer_tp_side huge = {1, 0, UINT64_MAX - 0x100, 64};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &sh, &p0, &huge, 16, r, 1, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "overflows"));
    const xfer_kv_shape bad = {1, 0, 2, 4, 2};
    assert_int_equal(xfer_plan_tp_request(p, 2, d, 2, &bad, &p0, &d1, 16, r, 1, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "bad KV shape"));
}

/* Layer-wise streaming: one layer of n paired blocks is one run per block at the layer's
 * offset; a range of layers is one longer run per block; all layers coalesce whole blocks
 * where both sides' ids are consecutive; bad ranges and ids are refused, naming them. */
static void test_plan_layers(void **state) {
    (void)state;
    const uint64_t bl = 4 * 1000; /* 4 layers of 1000 bytes */
    int64_t p[] = {3, 4, 5, 9}, d[] = {10, 11, 13, 14};
    xfer_run runs[8];
    char err[256];
    int n = xfer_plan_layers(p, d, 4, 0x100000, 0x900000, bl, 16, 4, 2, 1, runs, 8, err,
                             sizeof err);
    assert_int_equal(n, 4);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(runs[i].src, 0x100000 + (uint64_t)p[i] * bl + 2000);
        assert_int_equal(runs[i].dst, 0x900000 + (uint64_t)d[i] * bl + 2000);
        assert_int_equal(runs[i].len, 1000);
    }
    n = xfer_plan_layers(p, d, 4, 0, 0, bl, 16, 4, 1, 3, runs, 8, err, sizeof err);
    assert_int_equal(n, 4);
    assert_int_equal(runs[3].src, 9 * bl + 1000);
    assert_int_equal(runs[3].len, 3000);
    /* whole blocks: (3,10)(4,11) consecutive on both sides, then (5,13), (9,14) */
    n = xfer_plan_layers(p, d, 4, 0, 0, bl, 16, 4, 0, 4, runs, 8, err, sizeof err);
    assert_int_equal(n, 3);
    assert_int_equal(runs[0].src, 3 * bl);
    assert_int_equal(runs[0].dst, 10 * bl);
    assert_int_equal(runs[0].len, 2 * bl);
    assert_int_equal(runs[1].len, bl);
    /* refusals */
    assert_int_equal(xfer_plan_layers(p, d, 4, 0, 0, bl, 16, 4, 3, 2, runs, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "layers 3..4"));
    assert_int_equal(xfer_plan_layers(p, d, 4, 0, 0, bl, 16, 3, 0, 1, runs, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "3 equal layers"));
    assert_int_equal(xfer_plan_layers(p, d, 4, 0, 0, bl, 8, 4, 0, 1, runs, 8, err, sizeof err),
                     XFER_PLAN_EINVAL);
    assert_non_null(strstr(err, "prefill 9"));
    assert_int_equal(xfer_plan_layers(p, d, 4, 0, 0, bl, 16, 4, 0, 1, runs, 3, err, sizeof err),
                     XFER_PLAN_ENOSPC);
    assert_int_equal(xfer_plan_layers(p, d, 0, 0, 0, bl, 16, 4, 0, 1, runs, 8, err, sizeof err),
                     0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tail_and_coalescing),
        cmocka_unit_test(test_sparse_blocks_and_two_regions),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_tp_against_unsharded_reference),
        cmocka_unit_test(test_tp_exact_ranges),
        cmocka_unit_test(test_tp_random_sweep),
        cmocka_unit_test(test_tp_refusals),
        cmocka_unit_test(test_plan_layers),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
