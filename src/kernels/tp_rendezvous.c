/* tp_rendezvous — see tp_rendezvous.h. */
#include "kernels/tp_rendezvous.h"

#include "base/clock.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

int tp_rendezvous_publish(const char *path, const void *data, size_t n, char *err, size_t errlen) {
    if (!path || !*path || (!data && n) || n > TP_RENDEZVOUS_MAX) {
        snprintf(err, errlen, "TP rendezvous: no path, or a blob of %zu bytes (at most %d)", n,
                 TP_RENDEZVOUS_MAX);
        return -EINVAL;
    }
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        snprintf(err, errlen, "TP rendezvous: path too long: %.100s...", path);
        return -ENAMETOOLONG;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) {
        int e = errno;
        snprintf(err, errlen, "TP rendezvous: cannot create %s: %s", tmp, strerror(e));
        return -e;
    }
    const char *p = data;
    size_t left = n;
    while (left) {
        ssize_t w = write(fd, p, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = w < 0 ? errno : EIO;
            snprintf(err, errlen, "TP rendezvous: cannot write %s: %s", tmp, strerror(e));
            close(fd);
            unlink(tmp);
            return -e;
        }
        p += w;
        left -= (size_t)w;
    }
    if (close(fd) != 0 || rename(tmp, path) != 0) {
        int e = errno;
        snprintf(err, errlen, "TP rendezvous: cannot publish %s: %s", path, strerror(e));
        unlink(tmp);
        return -e;
    }
    return 0;
}

int tp_rendezvous_wait(const char *path, void *data, size_t n, double timeout_s, char *err,
                       size_t errlen) {
    if (!path || !*path || (!data && n) || n > TP_RENDEZVOUS_MAX || !(timeout_s >= 0) ||
        timeout_s > 86400) {
        snprintf(err, errlen,
                 "TP rendezvous: no path, a blob of %zu bytes (at most %d) or a timeout of %g s "
                 "(0..86400)",
                 n, TP_RENDEZVOUS_MAX, timeout_s);
        return -EINVAL;
    }
    uint64_t deadline = clock_now_ns() + (uint64_t)(timeout_s * 1e9);
    for (;;) {
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd >= 0) {
            struct stat st;
            if (fstat(fd, &st) != 0 || (size_t)st.st_size != n) {
                snprintf(err, errlen, "TP rendezvous: %s holds %lld bytes, expected %zu", path,
                         (long long)st.st_size, n);
                close(fd);
                return -EPROTO;
            }
            size_t got = 0;
            while (got < n) {
                ssize_t r = read(fd, (char *)data + got, n - got);
                if (r < 0 && errno == EINTR) continue;
                if (r <= 0) break;
                got += (size_t)r;
            }
            close(fd);
            if (got != n) {
                snprintf(err, errlen, "TP rendezvous: short read of %s (%zu of %zu bytes)", path,
                         got, n);
                return -EIO;
            }
            return 0;
        }
        if (errno != ENOENT) {
            int e = errno;
            snprintf(err, errlen, "TP rendezvous: cannot open %s: %s", path, strerror(e));
            return -e;
        }
        if (clock_remaining_ns(deadline) == 0) {
            snprintf(err, errlen,
                     "TP rendezvous: %s did not appear within %g s (is TP rank 0 running, with "
                     "the same rendezvous directory?)",
                     path, timeout_s);
            return -ETIMEDOUT;
        }
        clock_sleep_ns(10 * 1000000ull);
    }
}
