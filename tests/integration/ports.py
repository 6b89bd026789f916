"""Ports for the processes the tests and tools start: free now, outside the kernel's
ephemeral range, and never handed out twice, in one process or across processes running
side by side.  No dependency beyond the standard library (the tools on the GPU machine
import it too)."""
import fcntl
import os
import socket
from pathlib import Path

# Ports come from below the kernel's ephemeral range (32768-60999 by default): a port taken
# from the ephemeral range and released can be handed by the kernel to anyone's outgoing
# connection or `bind(0)` listener (our own servers' transfer and side-channel sockets
# included) before the server meant to use it binds it -- a bootstrap port was lost that way
# in CI.  Below the range only explicit binds compete.  Each port is handed out once per test
# process, and test processes running side by side (ctest -j runs one per test file) never
# hand out the same port: each port handed out is claimed with an flock on
# $TMPDIR/disagg-test-ports/PORT, held until the process exits.
_PORT_LO, _PORT_HI = 20000, 32760
_HANDED_OUT = set()
_PORT_LOCKS = []
_next_port = _PORT_LO + (os.getpid() * 97) % (_PORT_HI - _PORT_LO)


def _ephemeral_low():
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _claim(port):
    """True when this process now holds port's lock (no other test process has it)."""
    d = Path(os.environ.get("TMPDIR", "/tmp")) / "disagg-test-ports"
    try:
        d.mkdir(mode=0o777, exist_ok=True)
        fd = os.open(d / str(port), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:  # another user's directory: no claim across processes, the rest holds
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    _PORT_LOCKS.append(fd)
    return True


def free_port():
    """A port free now, outside the kernel's ephemeral range, never handed out before in
    this test process nor held by another (see above)."""
    global _next_port
    hi = min(_PORT_HI, _ephemeral_low())
    span = hi - _PORT_LO
    for _ in range(span):
        port = _PORT_LO + (_next_port - _PORT_LO) % span
        _next_port = port + 1
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if not _claim(port):
            continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {_PORT_LO}-{hi} not already handed out")
