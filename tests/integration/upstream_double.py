"""A test double of a disagg/vLLM OpenAI server instance (prefill or decode role)
and of a prefill instance's bootstrap server, implementing the documented
contracts of ../../shared/docs/PROTOCOL.md sections 1 and 2 -- nothing more:

* API server: GET /health, GET /v1/models, POST /v1/completions and
  /v1/chat/completions (JSON, or SSE with chunked transfer coding when
  "stream": true), answering deterministic text derived from the request.
* Bootstrap server (prefill only): GET /query -> {"<dp_rank>": {"engine_id":
  ..., "worker_addr": {"0": {"0": "tcp://..."}}}}.

Every request is recorded (method, path, headers, body, parsed JSON, the exact
response bytes sent, and whether the peer closed the connection before the
response ended) so tests can assert what the proxy sent.  Fault switches:
health_status, query_status / query_table, fail_status (completions answer
that HTTP status), close_connection (completions: close the socket without
answering), delay (seconds before answering), hold (the response waits until
release() or until the peer disconnects), stream_events / stream_interval,
health_hang (/health never answered), die_after_events (a stream cut mid-event),
renew_engine_on_query (prefill: every /query answer is followed by new engine ids,
as if the instance restarted right after it), known_engines (decode: a callable
returning the engine ids the prefill's bootstrap server knows; a remote_engine_id
outside them is answered 400 with the kv_consumer's own message, as
mooncake_consumer.c does).
stop() closes the listener and every open connection (like a killed
process); start() serves again on the same port.

Only the standard library: http.server with one thread per connection.
"""
import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr, handler, double):
        self.double = double
        self.conns = set()
        self.conns_lock = threading.Lock()
        super().__init__(addr, handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet
        pass

    def setup(self):
        super().setup()
        with self.server.conns_lock:
            self.server.conns.add(self.connection)

    def finish(self):
        with self.server.conns_lock:
            self.server.conns.discard(self.connection)
        try:
            super().finish()
        except OSError:
            pass

    # --- helpers -----------------------------------------------------------
    def _peer_closed(self, timeout):
        """Waits up to timeout; True if the peer closed the connection."""
        try:
            r, _, _ = select.select([self.connection], [], [], timeout)
            if r:
                data = self.connection.recv(1, socket.MSG_PEEK)
                return data == b""
        except OSError:
            return True
        return False

    def _send(self, rec, status, ctype, body, extra=None):
        head = [f"HTTP/1.1 {status} X", f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        for k, v in (extra or {}).items():
            head.append(f"{k}: {v}")
        raw = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        if rec is not None:
            rec["response_status"] = status
            rec["response_body"] = body
        self.wfile.write(raw)
        self.wfile.flush()

    def _read_body(self):
        n = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(n) if n else b""

    def _record(self, body):
        d = self.server.double
        try:
            js = json.loads(body) if body else None
        except ValueError:
            js = None
        rec = {
            "method": self.command,
            "path": self.path,
            "headers": {k.lower(): v for k, v in self.headers.items()},
            "body": body,
            "json": js,
            "time": time.monotonic(),
            "peer_closed": False,
            "done": threading.Event(),
            "response_status": None,
            "response_body": b"",
        }
        with d.lock:
            d.requests.append(rec)
        return rec

    # --- routes --------------------------------------------------------------
    def do_GET(self):
        d = self.server.double
        kind = self.server.kind
        rec = self._record(b"")
        try:
            if kind == "bootstrap":
                if self.path == "/query":
                    body = json.dumps(d.query_table()).encode()
                    self._send(rec, d.query_status, "application/json", body)
                    if d.renew_engine_on_query:
                        d.engine_generation += 1
                else:
                    self._send(rec, 404, "application/json", b'{"detail":"Not Found"}')
            elif self.path == "/health":
                while d.health_hang:  # a stopped process: connection accepted, no answer
                    if self._peer_closed(0.02):
                        rec["peer_closed"] = True
                        return
                self._send(rec, d.health_status, "application/json", b"")
            elif self.path == "/v1/models":
                body = json.dumps({"object": "list", "data": [
                    {"id": d.model, "object": "model", "owned_by": "disagg", "root": d.model}]}).encode()
                self._send(rec, 200, "application/json", body)
            else:
                self._send(rec, 404, "application/json", b'{"detail":"Not Found"}')
        finally:
            rec["done"].set()

    def do_POST(self):
        d = self.server.double
        body = self._read_body()
        rec = self._record(body)
        try:
            if self.server.kind != "api" or self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(rec, 404, "application/json", b'{"detail":"Not Found"}')
                return
            if d.close_connection:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if d.delay and self._peer_closed(d.delay):
                rec["peer_closed"] = True
                return
            if d.hold:
                while not d.released.is_set():
                    if self._peer_closed(0.02):
                        rec["peer_closed"] = True
                        return
            if d.fail_status:
                err = {"error": {"message": f"injected failure on {d.name}", "type": "InternalServerError",
                                 "param": None, "code": d.fail_status}}
                self._send(rec, d.fail_status, "application/json", json.dumps(err).encode())
                return
            req = rec["json"] or {}
            kv = req.get("kv_transfer_params") or {}
            if d.known_engines and kv.get("remote_engine_id") not in d.known_engines():
                msg = (f"remote prefill failed (transfer {kv.get('transfer_id')}): bootstrap server "
                       f"{kv.get('remote_bootstrap_addr')} knows no engine "
                       f"'{kv.get('remote_engine_id')}' (remote_engine_id)")
                err = {"error": {"message": msg, "type": "BadRequestError", "param": None,
                                 "code": 400}}
                self._send(rec, 400, "application/json", json.dumps(err).encode())
                return
            chat = self.path.endswith("chat/completions")
            if req.get("stream"):
                self._stream(rec, req, chat)
            else:
                self._send(rec, 200, "application/json", json.dumps(d.completion(req, chat)).encode(),
                           {"X-Double": d.name})
        except (BrokenPipeError, ConnectionResetError):
            rec["peer_closed"] = True
        finally:
            rec["done"].set()

    def do_PUT(self):
        self._send(None, 405, "application/json", b'{"detail":"Method Not Allowed"}')

    def _stream(self, rec, req, chat):
        d = self.server.double
        head = ("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                f"X-Double: {d.name}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
        self.wfile.write(head)
        self.wfile.flush()
        rec["response_status"] = 200
        sent = []
        for i, ev in enumerate(d.stream_events_for(req, chat)):
            if d.stream_interval and self._peer_closed(d.stream_interval):
                rec["peer_closed"] = True
                rec["response_body"] = b"".join(sent)
                return
            if d.die_after_events is not None and i == d.die_after_events:
                # like a killed process mid-stream: half an event, then the connection closes
                half = ev[:len(ev) // 2]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(half), half))
                self.wfile.flush()
                sent.append(half)
                rec["response_body"] = b"".join(sent)
                self.connection.shutdown(socket.SHUT_RDWR)
                self.close_connection = True
                return
            parts = [ev[:7], ev[7:]] if d.split_events else [ev]  # two TCP writes per event
            for part in parts:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
                self.wfile.flush()
                if d.split_events:
                    time.sleep(0.02)
            sent.append(ev)
        if d.stream_trailer:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(d.stream_trailer), d.stream_trailer))
            sent.append(d.stream_trailer)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        rec["response_body"] = b"".join(sent)


class UpstreamDouble:
    """One fake instance.  role: "prefill" (also runs a bootstrap server) or "decode"."""

    def __init__(self, role, name=None, host="127.0.0.1", port=0, bootstrap_port=0, dp_ranks=1,
                 model="double-model"):
        self.role = role
        self.name = name or role
        self.host = host
        self.model = model
        self.lock = threading.Lock()
        self.requests = []
        self.dp_ranks = dp_ranks
        self.engine_generation = 0
        self.health_status = 200
        self.health_hang = False  # GET /health is accepted and never answered (a stopped process)
        self.query_status = 200
        self.query_empty = False
        self.fail_status = 0
        self.close_connection = False
        self.delay = 0.0
        self.hold = False
        self.released = threading.Event()
        self.stream_events = 5
        self.stream_interval = 0.0
        self.die_after_events = None  # stream: after this many events, half an event and a reset
        self.split_events = False  # stream: each event in two writes 20 ms apart
        self.stream_trailer = b""  # stream: raw bytes after the last event (no event end)
        self.event_pad = 0  # bytes of padding added to every SSE event (large-stream tests)
        self.renew_engine_on_query = False  # prefill: new engine ids after every /query answer
        self.known_engines = None  # decode: () -> engine ids its prefill knows, or None
        self._port = port
        self._bport = bootstrap_port
        self._servers = []
        self._threads = []
        self.start()

    # --- lifecycle -----------------------------------------------------------
    def _serve(self, port, kind):
        srv = _Server((self.host, port), _Handler, self)
        srv.kind = kind
        t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        t.start()
        self._servers.append(srv)
        self._threads.append(t)
        return srv.server_address[1]

    def start(self):
        self._port = self._serve(self._port, "api")
        if self.role == "prefill":
            self._bport = self._serve(self._bport, "bootstrap")
        return self

    def stop(self):
        """Like a killed process: listener closed (connections refused) and every open connection reset."""
        for srv in self._servers:
            srv.shutdown()
            srv.server_close()
            with srv.conns_lock:
                for c in list(srv.conns):
                    try:
                        c.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
        self._servers, self._threads = [], []
        self.engine_generation += 1  # a restarted prefill registers new engine ids

    def restart(self):
        self.stop()
        return self.start()

    def release(self):
        self.released.set()

    # --- addresses -------------------------------------------------------------
    @property
    def port(self):
        return self._port

    @property
    def bootstrap_port(self):
        return self._bport

    @property
    def url(self):
        return f"http://{self.host}:{self._port}"

    def engine_id(self, rank):
        return f"engine-{self.name}-g{self.engine_generation}-dp{rank}"

    def query_table(self):
        if self.query_empty:
            return {}
        return {str(r): {"engine_id": self.engine_id(r),
                         "worker_addr": {"0": {"0": f"tcp://{self.host}:{40000 + r}"}}}
                for r in range(self.dp_ranks)}

    # --- recorded requests -------------------------------------------------------
    def completions(self):
        with self.lock:
            return [r for r in self.requests if r["method"] == "POST"]

    def clear(self):
        with self.lock:
            self.requests.clear()

    # --- deterministic answers -----------------------------------------------------
    def _text(self, req, i):
        seed = json.dumps(req.get("prompt", req.get("messages")), sort_keys=True)
        return f" tok{i}-{len(seed)}-{self.name}"

    def _ntokens(self, req):
        n = req.get("max_completion_tokens", req.get("max_tokens", self.stream_events))
        return max(1, min(int(n), 64))

    def completion(self, req, chat):
        n = self._ntokens(req)
        text = "".join(self._text(req, i) for i in range(n))
        usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "finish_reason": "length", "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length", "logprobs": None}
            obj = "text_completion"
        return {"id": f"cmpl-{self.name}", "object": obj, "created": 1700000000, "model": self.model,
                "choices": [choice], "usage": usage, "kv_transfer_params": None}

    def stream_events_for(self, req, chat):
        n = self._ntokens(req)
        for i in range(n):
            if chat:
                delta = {"role": "assistant", "content": ""} if i == 0 else {}
                delta["content"] = self._text(req, i)
                ch = {"index": 0, "delta": delta, "finish_reason": "length" if i == n - 1 else None,
                      "logprobs": None}
                obj = "chat.completion.chunk"
            else:
                ch = {"index": 0, "text": self._text(req, i),
                      "finish_reason": "length" if i == n - 1 else None, "logprobs": None}
                obj = "text_completion"
            ev = {"id": f"cmpl-{self.name}", "object": obj, "created": 1700000000, "model": self.model,
                  "choices": [ch]}
            if self.event_pad:
                ev["pad"] = chr(ord("a") + i % 26) * self.event_pad
            yield b"data: " + json.dumps(ev).encode() + b"\n\n"
        if (req.get("stream_options") or {}).get("include_usage"):
            u = {"id": f"cmpl-{self.name}", "object": "chat.completion.chunk" if chat else "text_completion",
                 "created": 1700000000, "model": self.model, "choices": [],
                 "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}}
            yield b"data: " + json.dumps(u).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
