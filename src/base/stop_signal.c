/* stop_signal — see stop_signal.h. */
#include "base/stop_signal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <string.h>
#include <unistd.h>

static int g_pipe[2] = {-1, -1};
static volatile sig_atomic_t g_sig;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static int g_err;

static void on_signal(int sig) {
    int saved = errno;
    g_sig = sig;
    char c = 1;
    ssize_t w = write(g_pipe[1], &c, 1); /* never blocks: non-blocking pipe */
    (void)w;
    errno = saved;
}

static void install(void) {
    if (pipe2(g_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
        g_err = -errno;
        return;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(SIGINT, &sa, NULL) != 0 || sigaction(SIGTERM, &sa, NULL) != 0) g_err = -errno;
}

int stop_signal_fd(void) {
    pthread_once(&g_once, install);
    return g_err ? g_err : g_pipe[0];
}

int stop_signal_received(void) {
    return (int)g_sig;
}
