/* rng — see rng.h. */
#include "base/rng.h"

#include <pthread.h>
#include <stddef.h>
#include <sys/random.h>
#include <sys/types.h>

uint64_t rng_mix64(uint64_t x) {
    uint64_t z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

uint64_t rng_splitmix64(uint64_t *x) {
    uint64_t z = rng_mix64(*x);
    *x += 0x9e3779b97f4a7c15ull;
    return z;
}

static inline uint64_t rotl(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

void rng_seed(rng_state *st, uint64_t seed) {
    for (int i = 0; i < 4; i++)
        st->s[i] = rng_splitmix64(&seed);
}

uint64_t rng_next(rng_state *st) {
    uint64_t *s = st->s;
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
}

double rng_uniform(rng_state *st) {
    return (double)(rng_next(st) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- the process-wide generator ------------------------------------------ */

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static rng_state g_state;
static int g_seeded;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void g_forget(void) {
    g_seeded = 0; /* in a forked child: draw a new seed */
}

static void g_atfork(void) {
    (void)pthread_atfork(NULL, NULL, g_forget);
}

uint64_t rng_global_next(void) {
    pthread_once(&g_once, g_atfork);
    pthread_mutex_lock(&g_mu);
    if (!g_seeded) {
        size_t got = 0;
        while (got < sizeof g_state.s) {
            ssize_t n = getrandom((char *)g_state.s + got, sizeof g_state.s - got, 0);
            if (n > 0) got += (size_t)n;
        }
        if (!(g_state.s[0] | g_state.s[1] | g_state.s[2] | g_state.s[3])) g_state.s[0] = 1;
        g_seeded = 1;
    }
    uint64_t r = rng_next(&g_state);
    pthread_mutex_unlock(&g_mu);
    return r;
}
