"""fault_relay — a fault-injecting TCP relay for the multi-host tests (this
kernel has no netem qdisc).  It listens on (host, port), and for every accepted
connection opens one to the target and copies bytes both ways, applying:

  delay_s      every chunk is forwarded delay_s after it arrived (latency, not
               a rate limit: chunks are queued, not slept on one by one)
  stall_after  after that many client->target bytes the relay stops forwarding
               in both directions and discards what it reads (a black hole:
               the peers see no error, only silence)
  reset_after  after that many client->target bytes both sockets are closed
               with SO_LINGER 0, so both peers get a connection reset

Faults apply to the connections numbered (from 0, in accept order) in
`faulty` (default: all), so "the first connection is reset, the retry goes
through" can be written.  black_hole_open() makes every connection open at
that moment silent at once, whatever its byte count (the path went dark for
the connections it carried; later ones are relayed).  stats() says what each
connection did.
"""
import heapq
import socket
import struct
import threading
import time


class _Conn:
    def __init__(self, relay, index, client):
        self.relay = relay
        self.index = index
        self.client = client
        self.server = None
        self.faulty = relay.faulty is None or index in relay.faulty
        self.up = 0  # client -> target bytes read
        self.down = 0  # target -> client bytes read
        self.outcome = "open"
        self.silenced = False  # black_hole_open(): swallow everything from now on
        self.lock = threading.Lock()
        self.closed = False

    def close(self, reset=False):
        with self.lock:
            if self.closed:
                return
            self.closed = True
        for s in (self.client, self.server):
            if s is None:
                continue
            try:
                if reset:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass


class FaultRelay:
    def __init__(self, host, port, target_host, target_port, delay_s=0.0, stall_after=None,
                 reset_after=None, faulty=None):
        self.target = (target_host, target_port)
        self.delay_s = delay_s
        self.stall_after = stall_after
        self.reset_after = reset_after
        self.faulty = set(faulty) if faulty is not None else None
        self.conns = []
        self.stopped = False
        self.ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((host, port))
        self.ls.listen(64)
        self.addr = self.ls.getsockname()
        self.thread = threading.Thread(target=self._accept_loop, daemon=True)
        self.thread.start()

    def _accept_loop(self):
        while not self.stopped:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            conn = _Conn(self, len(self.conns), c)
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn):
        try:
            conn.server = socket.create_connection(self.target, timeout=10)
            conn.server.settimeout(None)
        except OSError:
            conn.outcome = "target unreachable"
            conn.close()
            return
        for s in (conn.client, conn.server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t = threading.Thread(target=self._pump, args=(conn, conn.server, conn.client, False), daemon=True)
        t.start()
        self._pump(conn, conn.client, conn.server, True)
        t.join()

    def _pump(self, conn, src, dst, upstream):
        """Copy src -> dst through a delay queue, applying the faults."""
        queue, cv, done = [], threading.Condition(), [False]
        seq = [0]

        def writer():
            while True:
                with cv:
                    while not queue and not done[0]:
                        cv.wait()
                    if not queue:
                        return
                    due, _, data = queue[0]
                    now = time.monotonic()
                    if due > now:
                        cv.wait(due - now)
                        continue
                    heapq.heappop(queue)
                try:
                    dst.sendall(data)
                except OSError:
                    return

        w = None
        if self.delay_s > 0:
            w = threading.Thread(target=writer, daemon=True)
            w.start()
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                break
            if upstream:
                before = conn.up
                conn.up += len(data)
                if conn.silenced:
                    conn.outcome = "stalled (black_hole_open)"
                    self._blackhole(conn, src)
                    break
                if conn.faulty and self.reset_after is not None and conn.up >= self.reset_after:
                    keep = max(0, self.reset_after - before)
                    if keep:
                        try:
                            dst.sendall(data[:keep])
                        except OSError:
                            pass
                    conn.outcome = f"reset after {self.reset_after} bytes"
                    conn.close(reset=True)
                    break
                if conn.faulty and self.stall_after is not None and conn.up > self.stall_after:
                    keep = max(0, self.stall_after - before)
                    if keep:
                        try:
                            dst.sendall(data[:keep])
                        except OSError:
                            pass
                    conn.outcome = f"stalled after {self.stall_after} bytes"
                    self._blackhole(conn, src)
                    break
            else:
                conn.down += len(data)
                if conn.outcome.startswith("stalled") or conn.silenced:
                    continue  # the black hole swallows replies too
            if w:
                with cv:
                    seq[0] += 1
                    heapq.heappush(queue, (time.monotonic() + self.delay_s, seq[0], data))
                    cv.notify()
            else:
                try:
                    dst.sendall(data)
                except OSError:
                    break
        if w:
            with cv:
                done[0] = True
                cv.notify()
            w.join()
        if conn.outcome == "open":
            conn.outcome = "closed"
        if not conn.outcome.startswith("stalled"):
            conn.close()

    @staticmethod
    def _blackhole(conn, src):
        """Read and drop until the peer gives up (or the relay stops)."""
        while True:
            try:
                if not src.recv(1 << 16):
                    break
            except OSError:
                break
        conn.close()

    def black_hole_open(self):
        """Every connection open now goes silent (reads and drops, answers nothing);
        connections accepted later are relayed.  Returns how many were open."""
        n = 0
        for c in self.conns:
            if not c.closed and c.outcome == "open":
                c.silenced = True
                n += 1
        return n

    def stats(self):
        return [{"index": c.index, "up": c.up, "down": c.down, "outcome": c.outcome} for c in self.conns]

    def close(self):
        self.stopped = True
        try:
            self.ls.close()
        except OSError:
            pass
        for c in self.conns:
            c.close()
