/*
 * tp_launch — rank 0 spawning and watching the other ranks of `serve -tp N` (see tp_launch.h).
 */
#include "cli/tp_launch.h"

#include "base/log.h"
#include "kernels/collective.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MOD "tp"

extern char **environ;

static struct {
    int n;                            /* ranks */
    pid_t pid[COLLECTIVE_MAX_RANKS];  /* workers' pids (index = rank; 0 unused) */
    int pidfd[COLLECTIVE_MAX_RANKS];  /* their pidfds */
    int exited[COLLECTIVE_MAX_RANKS]; /* 1: reaped */
    volatile int stopping;            /* tp_launch_stop began: exits are expected */
    volatile int failed;              /* a worker exited while serving */
    int wake[2];                      /* stop the watcher */
    pthread_t watcher;
    collective *c;
    int kv_fd[COLLECTIVE_MAX_RANKS]; /* share_kv: each worker's KV memfd (0 unused), else -1 */
    int share_kv;
} L;

static void describe(int status, char *out, size_t cap) {
    if (WIFEXITED(status))
        snprintf(out, cap, "exited with status %d", WEXITSTATUS(status));
    else if (WIFSIGNALED(status))
        snprintf(out, cap, "was killed by signal %d (%s)", WTERMSIG(status),
                 strsignal(WTERMSIG(status)));
    else
        snprintf(out, cap, "ended (status 0x%x)", status);
}

static void *watch_main(void *arg) {
    (void)arg;
    struct pollfd p[COLLECTIVE_MAX_RANKS + 1];
    for (;;) {
        int k = 0, who[COLLECTIVE_MAX_RANKS + 1];
        p[k].fd = L.wake[0], p[k].events = POLLIN, who[k++] = 0;
        for (int r = 1; r < L.n; r++)
            if (!L.exited[r]) p[k].fd = L.pidfd[r], p[k].events = POLLIN, who[k++] = r;
        if (k == 1) return NULL;
        if (poll(p, (nfds_t)k, -1) < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        if (p[0].revents) return NULL;
        for (int i = 1; i < k; i++) {
            if (!p[i].revents) continue;
            int r = who[i], status = 0;
            if (waitpid(L.pid[r], &status, 0) != L.pid[r]) continue;
            L.exited[r] = 1;
            /* status 0: the worker took rank 0's stop (the engine ended before
             * tp_launch_stop was called) */
            if (L.stopping || (WIFEXITED(status) && WEXITSTATUS(status) == 0)) continue;
            char how[96], what[192];
            describe(status, how, sizeof how);
            snprintf(what, sizeof what, "tensor-parallel worker rank %d (pid %d) %s", r,
                     (int)L.pid[r], how);
            L.failed = 1;
            collective_poison(L.c, what);
            LOG_E(MOD, "%s: the server cannot run without it; stopping", what);
            /* the forward in flight fails at once (the group is poisoned): a moment for its
             * requests' error replies to leave before the shutdown closes connections */
            struct timespec grace = {0, 200 * 1000 * 1000};
            nanosleep(&grace, NULL);
            kill(getpid(), SIGTERM);
        }
    }
}

/* /proc/self/cmdline as an argv (malloc'd; *buf holds the strings) */
static char **self_argv(char **buf) {
    FILE *f = fopen("/proc/self/cmdline", "rb");
    if (!f) return NULL;
    size_t cap = 1 << 16, n = 0;
    char *b = malloc(cap + 1);
    size_t got;
    while (b && (got = fread(b + n, 1, cap - n, f)) > 0) {
        n += got;
        if (n == cap) {
            char *q = realloc(b, 2 * cap + 1);
            if (!q) {
                free(b);
                b = NULL;
                break;
            }
            b = q;
            cap *= 2;
        }
    }
    fclose(f);
    if (!b) return NULL;
    b[n] = 0;
    int argc = 0;
    for (size_t i = 0; i < n; i++)
        argc += b[i] == 0;
    char **v = calloc((size_t)argc + 1, sizeof *v);
    if (!v) {
        free(b);
        return NULL;
    }
    for (size_t i = 0, a = 0; i < n && (int)a < argc; a++) {
        v[a] = b + i;
        i += strlen(b + i) + 1;
    }
    *buf = b;
    return v;
}

static void close_kv_fds(void) {
    for (int r = 0; r < COLLECTIVE_MAX_RANKS; r++)
        if (L.kv_fd[r] >= 0) close(L.kv_fd[r]);
}

const int *tp_launch_kv_fds(void) {
    return L.share_kv ? L.kv_fd : NULL;
}

int tp_launch_start(int n, int share_kv, collective **out, char *err, size_t errlen) {
    *out = NULL;
    memset(&L, 0, sizeof L);
    L.wake[0] = L.wake[1] = -1;
    for (int r = 0; r < COLLECTIVE_MAX_RANKS; r++)
        L.kv_fd[r] = -1;
    L.share_kv = share_kv;
    for (int r = 1; share_kv && r < n; r++) {
        char name[48];
        snprintf(name, sizeof name, "disagg-kv-rank%d", r);
        if ((L.kv_fd[r] = memfd_create(name, MFD_CLOEXEC)) < 0) {
            snprintf(err, errlen, "cannot make rank %d's shared KV region (memfd_create: %s)", r,
                     strerror(errno));
            close_kv_fds();
            return -errno;
        }
    }
    /* a slot holds a prefill chunk's hidden states or a logits chunk; the message a step */
    int rc = collective_create(n, (size_t)16 << 20, (size_t)64 << 20, &L.c, err, errlen);
    if (rc) return rc;
    if ((rc = collective_join(L.c, 0))) {
        snprintf(err, errlen, "cannot join the tensor-parallel group as rank 0");
        goto fail;
    }
    char *argbuf = NULL, **argv = self_argv(&argbuf);
    size_t ne = 0;
    while (environ[ne])
        ne++;
    char **envp = calloc(ne + 2, sizeof *envp);
    char envvar[COLLECTIVE_MAX_RANKS][64];
    if (!argv || !envp || pipe2(L.wake, O_CLOEXEC)) {
        snprintf(err, errlen, "cannot prepare the tensor-parallel workers: %s", strerror(errno));
        free(argv);
        free(argbuf);
        free(envp);
        rc = -ENOMEM;
        goto fail;
    }
    for (size_t i = 0, k = 0; i < ne; i++)
        if (strncmp(environ[i], TP_LAUNCH_ENV "=", sizeof TP_LAUNCH_ENV)) envp[k++] = environ[i];
    size_t env_at = 0;
    while (envp[env_at])
        env_at++;
    L.n = n;
    pid_t parent = getpid();
    int fd = collective_fd(L.c);
    for (int r = 1; r < n; r++) {
        if (L.kv_fd[r] >= 0)
            snprintf(envvar[r], sizeof envvar[r], TP_LAUNCH_ENV "=%d:%d:%d", r, fd, L.kv_fd[r]);
        else
            snprintf(envvar[r], sizeof envvar[r], TP_LAUNCH_ENV "=%d:%d", r, fd);
        envp[env_at] = envvar[r];
        pid_t pid = fork();
        if (pid == 0) {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            if (getppid() != parent) _exit(1);
            int fl = fcntl(fd, F_GETFD);
            if (fl >= 0) fcntl(fd, F_SETFD, fl & ~FD_CLOEXEC);
            if (L.kv_fd[r] >= 0) fcntl(L.kv_fd[r], F_SETFD, 0);
            execve("/proc/self/exe", argv, envp);
            _exit(127);
        }
        if (pid < 0) {
            snprintf(err, errlen, "cannot start tensor-parallel worker %d: %s", r, strerror(errno));
            rc = -errno;
            break;
        }
        L.pid[r] = pid;
        L.pidfd[r] = (int)syscall(SYS_pidfd_open, pid, 0);
        if (L.pidfd[r] < 0) {
            snprintf(err, errlen, "pidfd_open of worker %d: %s", r, strerror(errno));
            rc = -errno;
            break;
        }
    }
    free(argv);
    free(argbuf);
    free(envp);
    if (!rc && pthread_create(&L.watcher, NULL, watch_main, NULL)) {
        snprintf(err, errlen, "cannot start the tensor-parallel watcher");
        rc = -ENOMEM;
    }
    if (rc) goto fail;
    LOG_I(MOD, "tensor parallelism: %d ranks (this process is rank 0)", n);
    for (int r = 1; r < n; r++)
        LOG_I(MOD, "rank %d: pid %d", r, (int)L.pid[r]);
    *out = L.c;
    return 0;
fail:
    L.stopping = 1;
    for (int r = 1; r < COLLECTIVE_MAX_RANKS; r++)
        if (L.pid[r] > 0) {
            kill(L.pid[r], SIGKILL);
            waitpid(L.pid[r], NULL, 0);
            if (L.pidfd[r] > 0) close(L.pidfd[r]);
        }
    if (L.wake[0] >= 0) close(L.wake[0]), close(L.wake[1]);
    collective_free(L.c);
    close_kv_fds();
    memset(&L, 0, sizeof L);
    return rc;
}

int tp_launch_stop(collective *c, int abort) {
    if (!c || c != L.c) return 0;
    L.stopping = 1;
    if (abort && !collective_poisoned(c)) collective_poison(c, "rank 0 stopped");
    if (write(L.wake[1], "x", 1) < 0) { /* the watcher stops polling */
    }
    pthread_join(L.watcher, NULL);
    for (int r = 1; r < L.n; r++) {
        if (L.exited[r]) continue;
        int status = 0;
        /* 2 s for a clean exit after the stop message; then the group is failed (a worker
         * still waiting for a start that never came leaves at once); 5 s more, then killed */
        for (int i = 0; i < 700 && !L.exited[r]; i++) {
            if (i == 200 && !collective_poisoned(c)) collective_poison(c, "rank 0 stopped");
            if (waitpid(L.pid[r], &status, WNOHANG) == L.pid[r]) {
                L.exited[r] = 1;
                break;
            }
            struct timespec ts = {0, 10 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
        if (!L.exited[r]) {
            LOG_W(MOD, "tensor-parallel worker rank %d (pid %d) did not stop: killed", r,
                  (int)L.pid[r]);
            kill(L.pid[r], SIGKILL);
            waitpid(L.pid[r], NULL, 0);
        }
    }
    for (int r = 1; r < L.n; r++)
        close(L.pidfd[r]);
    close(L.wake[0]);
    close(L.wake[1]);
    int failed = L.failed;
    collective_free(L.c);
    close_kv_fds();
    memset(&L, 0, sizeof L);
    return failed;
}

int tp_launch_worker_env(int *rank, int *fd, int *kv_fd, char *err, size_t errlen) {
    const char *v = getenv(TP_LAUNCH_ENV);
    if (!v || !*v) return 0;
    int r = -1, f = -1, k = -1, n2 = 0, n3 = 0;
    int ok = sscanf(v, "%d:%d%n", &r, &f, &n2) == 2 && n2 > 0 &&
             (v[n2] == 0 || (sscanf(v + n2, ":%d%n", &k, &n3) == 1 && v[n2 + n3] == 0 && k >= 0));
    if (!ok || r < 1 || r >= COLLECTIVE_MAX_RANKS || f < 0) {
        snprintf(err, errlen,
                 "%s='%s': expected <rank>:<fd>[:<kv_fd>] (set by disagg serve -tp N itself)",
                 TP_LAUNCH_ENV, v);
        return -1;
    }
    *rank = r;
    *fd = f;
    *kv_fd = k;
    return 1;
}
