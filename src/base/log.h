/*
 * log — leveled logging to stderr (never stdout: stdout belongs to commands'
 * results).  Level from DISAGG_LOG_LEVEL (debug|info|warn|error, default info)
 * or log_set_level().  Thread-safe: one write(2) per line.
 */
#ifndef DISAGG_BASE_LOG_H
#define DISAGG_BASE_LOG_H

#include <stdarg.h>

typedef enum log_level {
    LOG_DEBUG = 0,
    LOG_INFO = 1,
    LOG_WARN = 2,
    LOG_ERROR = 3,
    LOG_OFF = 4
} log_level;

void log_set_level(log_level level);
log_level log_get_level(void);
/* Parses "debug", "info", "warn", "error", "off"; returns -1 if unknown. */
int log_parse_level(const char *s);
void log_msg(log_level level, const char *module, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

#define LOG_D(mod, ...) log_msg(LOG_DEBUG, mod, __VA_ARGS__)
#define LOG_I(mod, ...) log_msg(LOG_INFO, mod, __VA_ARGS__)
#define LOG_W(mod, ...) log_msg(LOG_WARN, mod, __VA_ARGS__)
#define LOG_E(mod, ...) log_msg(LOG_ERROR, mod, __VA_ARGS__)

#endif
