/* clock — see clock.h. */
#include "clock.h"

#include <errno.h>
#include <stdint.h>

uint64_t clock_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * NS_PER_S + (uint64_t)ts.tv_nsec;
}

uint64_t clock_remaining_ns(uint64_t deadline_ns) {
    uint64_t now = clock_now_ns();
    return deadline_ns > now ? deadline_ns - now : 0;
}

int clock_remaining_ms(uint64_t deadline_ns) {
    uint64_t r = clock_remaining_ns(deadline_ns);
    uint64_t ms = (r + NS_PER_MS - 1) / NS_PER_MS;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

struct timespec clock_to_timespec(uint64_t abs_ns) {
    struct timespec ts = {.tv_sec = (time_t)(abs_ns / NS_PER_S),
                          .tv_nsec = (long)(abs_ns % NS_PER_S)};
    return ts;
}

int clock_cond_init(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc) return rc;
    rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!rc) rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

void clock_sleep_ns(uint64_t ns) {
    struct timespec ts = {.tv_sec = (time_t)(ns / NS_PER_S), .tv_nsec = (long)(ns % NS_PER_S)};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}
