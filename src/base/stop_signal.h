/*
 * stop_signal — SIGINT/SIGTERM as a readable file descriptor, for commands
 * that serve until asked to stop.  The handler is process-wide (sigaction), so
 * it works whichever thread the kernel picks — including threads that
 * libraries such as OpenBLAS start before main() — unlike a signal mask plus
 * signalfd.  The fd becomes readable (and stays so) once a signal came.
 */
#ifndef DISAGG_BASE_STOP_SIGNAL_H
#define DISAGG_BASE_STOP_SIGNAL_H

/* Installs the handlers (once) and returns the read end; -errno on failure. */
int stop_signal_fd(void);
/* The signal number received, 0 if none yet. */
int stop_signal_received(void);

#endif
