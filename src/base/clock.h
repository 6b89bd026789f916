/*
 * clock — monotonic time in nanoseconds and deadline helpers.  Every wait in
 * disagg has a deadline expressed as an absolute clock_now_ns() value.
 */
#ifndef DISAGG_BASE_CLOCK_H
#define DISAGG_BASE_CLOCK_H

#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define NS_PER_US 1000ull
#define NS_PER_MS 1000000ull
#define NS_PER_S  1000000000ull

/* CLOCK_MONOTONIC in ns. */
uint64_t clock_now_ns(void);
/* Remaining ns until deadline (0 if passed). */
uint64_t clock_remaining_ns(uint64_t deadline_ns);
/* Remaining time as poll(2) milliseconds, rounded up, at most INT32_MAX; 0 if passed. */
int clock_remaining_ms(uint64_t deadline_ns);
/* Absolute CLOCK_MONOTONIC timespec for pthread_cond_timedwait on a
 * monotonic condvar (see clock_cond_init).  On a default (CLOCK_REALTIME)
 * condvar such a deadline lies decades in the past: the wait returns at once
 * and a waiting loop spins. */
struct timespec clock_to_timespec(uint64_t abs_ns);
/* pthread_cond_init on CLOCK_MONOTONIC, so that clock_to_timespec deadlines
 * mean what they say.  0 or a pthread error number. */
int clock_cond_init(pthread_cond_t *cv);
/* Sleep for ns (restarts on EINTR). */
void clock_sleep_ns(uint64_t ns);

#endif
