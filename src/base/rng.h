/*
 * rng — the project's one pseudo-random generator: splitmix64 (a stateless
 * mixer, also the seeder) and xoshiro256** (Blackman & Vigna) on a caller's
 * state, plus a process-wide generator seeded from getrandom (re-seeded in a
 * forked child) for ids that must be unique but not secret.  Nothing here is
 * for secrets: base/auth.h draws nonces from OpenSSL.
 * The sampler's seeded streams (model/sampler.c) and the transfer harness's
 * pattern (bench/transfer_pattern.c) depend on these exact sequences.
 */
#ifndef DISAGG_BASE_RNG_H
#define DISAGG_BASE_RNG_H

#include <stdint.h>

/* splitmix64 of x (one step of the sequence x, x + golden, ...). */
uint64_t rng_mix64(uint64_t x);
/* splitmix64 as a generator: advances *x and returns the next value. */
uint64_t rng_splitmix64(uint64_t *x);

/* xoshiro256** state. */
typedef struct rng_state {
    uint64_t s[4]; /* never all zero */
} rng_state;

/* Seeds st from seed through splitmix64 (the same seed gives the same stream). */
void rng_seed(rng_state *st, uint64_t seed);
/* Next 64 bits. */
uint64_t rng_next(rng_state *st);
/* Uniform in [0, 1) with 53 bits. */
double rng_uniform(rng_state *st);

/* 64 bits of the process-wide generator (seeded from getrandom on first use
 * and again in a forked child).  Thread-safe. */
uint64_t rng_global_next(void);

#endif
