/* log — see log.h. */
#include "log.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static atomic_int g_level = -1;

static log_level level_now(void) {
    int l = atomic_load(&g_level);
    if (l >= 0) return (log_level)l;
    const char *env = getenv("DISAGG_LOG_LEVEL");
    int p = env ? log_parse_level(env) : -1;
    l = p >= 0 ? p : LOG_INFO;
    atomic_store(&g_level, l);
    return (log_level)l;
}

void log_set_level(log_level level) {
    atomic_store(&g_level, (int)level);
}
log_level log_get_level(void) {
    return level_now();
}

int log_parse_level(const char *s) {
    static const char *names[] = {"debug", "info", "warn", "error", "off"};
    for (int i = 0; i < 5; i++)
        if (strcmp(s, names[i]) == 0) return i;
    if (strcmp(s, "warning") == 0) return LOG_WARN;
    return -1;
}

void log_msg(log_level level, const char *module, const char *fmt, ...) {
    if (level < level_now()) return;
    static const char tag[] = "DIWE";
    char line[2048];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%c %02d:%02d:%02d.%03ld %s: ", tag[level], tm.tm_hour,
                     tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000, module);
    va_list ap;
    va_start(ap, fmt);
    if (n > 0 && (size_t)n < sizeof line)
        n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
    line[n++] = '\n';
    ssize_t w = write(STDERR_FILENO, line, (size_t)n);
    (void)w;
}
