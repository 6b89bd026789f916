/*
 * transfer_spawn — the one way the transfer bench and harness start a target
 * (see transfer_bench.h): this binary forked and exec'd with the target's
 * arguments, its stdin and stdout piped to us, SIGTERM when we die; the
 * first line it prints is its "target ready" line -- one format for every
 * target, written and read here (tb_ready_print, tb_ready_parse).
 */
#include "bench/transfer_bench.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int tb_ready_print(transfer_engine *e, bool auth, transfer_protocol protocol,
                   const tb_ready_buf *bufs, size_t n, json_t *extra) {
    json_t *arr = json_array();
    for (size_t i = 0; arr && i < n; i++)
        json_array_append_new(arr,
                              json_pack("{s:I,s:I,s:s}", "addr", (json_int_t)bufs[i].addr, "length",
                                        (json_int_t)bufs[i].length, "location", bufs[i].location));
    json_t *line =
        json_pack("{s:s,s:i,s:i,s:b,s:s,s:o}", "segment", transfer_engine_segment_name(e),
                  "tcp_data_port", (int)transfer_engine_data_port(e), "pid", (int)getpid(), "auth",
                  auth, "protocol", transfer_protocol_name(protocol), "buffers", arr);
    if (line && extra) json_object_update(line, extra);
    json_decref(extra);
    char *text = line ? json_dumps(line, JSON_COMPACT) : NULL;
    json_decref(line);
    if (!text) {
        fprintf(stderr, "transfer target: out of memory for the ready line\n");
        return -1;
    }
    printf("%s\n", text);
    fflush(stdout);
    free(text);
    return 0;
}

json_t *tb_ready_parse(const char *line, char *err, size_t cap) {
    json_error_t je;
    json_t *j = json_loads(line, 0, &je);
    const char *why = NULL;
    if (!j || !json_is_object(j))
        why = "not a JSON object";
    else if (!json_is_string(json_object_get(j, "segment")))
        why = "no string \"segment\"";
    else if (!json_is_integer(json_object_get(j, "pid")))
        why = "no integer \"pid\"";
    else if (!json_is_array(json_object_get(j, "buffers")) ||
             !json_array_size(json_object_get(j, "buffers")))
        why = "no \"buffers\" array";
    for (size_t i = 0; !why && i < json_array_size(json_object_get(j, "buffers")); i++) {
        json_t *b = json_array_get(json_object_get(j, "buffers"), i);
        if (!json_is_integer(json_object_get(b, "addr")) ||
            !json_is_integer(json_object_get(b, "length")))
            why = "a buffer without integer \"addr\" and \"length\"";
    }
    if (!why) return j;
    snprintf(err, cap, "not a target ready line (%s): %.200s", why, line);
    json_decref(j);
    return NULL;
}

uint64_t tb_ready_u64(const json_t *ready, size_t i, const char *k) {
    json_t *b = json_array_get(json_object_get(ready, "buffers"), i);
    return (uint64_t)json_integer_value(json_object_get(b, k));
}

static uint64_t sp_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

int tb_proc_read_line(tb_proc *c, char *line, size_t cap, uint64_t timeout_ns) {
    uint64_t deadline = sp_now_ns() + timeout_ns;
    size_t n = 0;
    while (n + 1 < cap) {
        uint64_t now = sp_now_ns();
        if (now >= deadline) return -1;
        struct pollfd pfd = {.fd = c->out, .events = POLLIN};
        int r = poll(&pfd, 1, (int)((deadline - now) / 1000000ull) + 1);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) continue;
        ssize_t got = read(c->out, line + n, 1);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        if (line[n] == '\n') break;
        n++;
    }
    line[n] = 0;
    return 0;
}

int tb_spawn(const char *who, const char *const argv[], uint64_t timeout_ns, tb_proc *c, char *line,
             size_t cap) {
    c->pid = 0;
    c->in = c->out = -1;
    int to[2], from[2];
    if (pipe2(to, O_CLOEXEC)) {
        fprintf(stderr, "%s: pipe: %s\n", who, strerror(errno));
        return 1;
    }
    if (pipe2(from, O_CLOEXEC)) {
        fprintf(stderr, "%s: pipe: %s\n", who, strerror(errno));
        close(to[0]);
        close(to[1]);
        return 1;
    }
    fflush(stdout);
    fflush(stderr);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, "%s: fork: %s\n", who, strerror(errno));
        close(to[0]);
        close(to[1]);
        close(from[0]);
        close(from[1]);
        return 1;
    }
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent) _exit(1);
        if (dup2(to[0], STDIN_FILENO) < 0 || dup2(from[1], STDOUT_FILENO) < 0) _exit(1);
        execv("/proc/self/exe", (char *const *)argv);
        fprintf(stderr, "%s: exec /proc/self/exe: %s\n", who, strerror(errno));
        _exit(127);
    }
    close(to[0]);
    close(from[1]);
    c->pid = pid;
    c->in = to[1];
    c->out = from[0];
    if (tb_proc_read_line(c, line, cap, timeout_ns) == 0) return 0;
    fprintf(stderr,
            "%s: the forked target (pid %d) printed no ready line within %.0f s (see its error "
            "above)\n",
            who, (int)pid, (double)timeout_ns / 1e9);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    close(c->in);
    close(c->out);
    c->pid = 0;
    c->in = c->out = -1;
    return 1;
}

int tb_proc_stop(tb_proc *c, int sig, uint64_t timeout_ns) {
    if (c->pid <= 0) return -1;
    if (c->in >= 0) close(c->in);
    c->in = -1;
    if (sig) kill(c->pid, sig);
    int status = -1;
    uint64_t deadline = sp_now_ns() + timeout_ns;
    for (;;) {
        pid_t r = waitpid(c->pid, &status, WNOHANG);
        if (r == c->pid) break;
        if (r < 0 && errno != EINTR) break;
        if (sp_now_ns() > deadline) {
            kill(c->pid, SIGKILL);
            waitpid(c->pid, &status, 0);
            status = -2;
            break;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    if (c->out >= 0) close(c->out);
    c->out = -1;
    c->pid = 0;
    return status;
}
