"""mooncake_wire — a small, independent Python client of the transfer engine's
wire formats (no code shared with the C engine): the handshake (RPC) frames
and the Mooncake TCP v2 data protocol, as Mooncake's own source has them
(mooncake-transfer-engine/include/common.h writeString/readString,
transfer_metadata_plugin.cpp SocketHandShakePlugin, tcp_transport.cpp).
test_mooncake_interop.py checks the engine against the real Mooncake wheel;
this client is for what the wheel cannot send: malformed frames, raw attackers.

Handshake frame:  u64 length (LE) | u8 type | JSON, length = 1 + len(JSON)
  (it counts the type byte); type 1 metadata (answer: the peer's
  descriptor), type 3 probe (answer {"status": "success"}).
Data request:     u64 size | u64 addr | u8 opcode (0x80 | op) | 7 pad  (24 bytes, LE)
  op 0 READ, 1 WRITE; status word u64 = 0x4D43545600000000 | code
  (0 ok, 1 address rejected, 2 malformed).
"""
import json
import socket
import struct

FRAME_METADATA = 1
FRAME_PROBE = 3

OP_READ = 0
OP_WRITE = 1
OPCODE_FLAG = 0x80

STATUS_MAGIC = 0x4D43545600000000
STATUS_OK = 0
STATUS_REJECTED = 1
STATUS_MALFORMED = 2

HEADER = struct.Struct("<QQB7x")
assert HEADER.size == 24


class WireError(Exception):
    """The peer answered something the wire spec does not allow."""


def split_segment(name):
    """'ip:port' or '[ip6]:port' -> (host, port)."""
    if name.startswith("["):
        host, _, port = name[1:].partition("]:")
    else:
        host, _, port = name.rpartition(":")
    return host, int(port)


def connect(host, port, timeout=5.0):
    s = socket.create_connection((host, port), timeout=timeout)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.settimeout(timeout)
    return s


def recv_exact(sock, n):
    """Exactly n bytes, or WireError on EOF."""
    chunks = []
    got = 0
    while got < n:
        b = sock.recv(min(n - got, 1 << 20))
        if not b:
            raise WireError(f"connection closed after {got} of {n} bytes")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def encode_frame(ftype, payload):
    """A handshake frame; payload is bytes or a JSON-serialisable object."""
    if not isinstance(payload, (bytes, bytearray)):
        payload = json.dumps(payload).encode()
    return struct.pack("<QB", len(payload) + 1, ftype) + bytes(payload)


def read_frame(sock, max_len=16 << 20):
    """-> (type, parsed JSON) of one answer frame."""
    length, ftype = struct.unpack("<QB", recv_exact(sock, 9))
    if length == 0 or length > max_len:
        raise WireError(f"answer frame length {length} is not in 1..{max_len}")
    body = recv_exact(sock, length - 1)
    try:
        return ftype, json.loads(body)
    except ValueError as e:
        raise WireError(f"answer frame is not JSON: {body[:80]!r}") from e


def handshake(segment, ftype=FRAME_METADATA, payload=None, timeout=5.0):
    """One request/answer on the handshake port (one connection per message)."""
    host, port = split_segment(segment)
    with connect(host, port, timeout) as s:
        s.sendall(encode_frame(ftype, {} if payload is None else payload))
        return read_frame(s)


def fetch_descriptor(segment, timeout=5.0):
    ftype, desc = handshake(segment, FRAME_METADATA, {}, timeout)
    if ftype != FRAME_METADATA:
        raise WireError(f"metadata answered with frame type {ftype}")
    if not isinstance(desc, dict) or "error" in desc:
        raise WireError(f"metadata answer is not a descriptor: {desc!r}")
    return desc


def decode_status(raw):
    """u64 status word -> code; WireError when the magic is wrong."""
    (word,) = struct.unpack("<Q", raw)
    if word & 0xFFFFFFFF00000000 != STATUS_MAGIC:
        raise WireError(f"status word 0x{word:016x} lacks the magic 0x{STATUS_MAGIC:016x}")
    return word & 0xFFFFFFFF


def encode_header(size, addr, op):
    return HEADER.pack(size, addr, OPCODE_FLAG | op)


class DataConn:
    """One persistent connection to a target's TCP data port."""

    def __init__(self, host, port, timeout=5.0):
        self.sock = connect(host, port, timeout)

    @classmethod
    def from_descriptor(cls, segment, desc, timeout=5.0):
        host, _ = split_segment(segment)
        return cls(host, int(desc["tcp_data_port"]), timeout)

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, data):
        self.sock.sendall(data)

    def status(self):
        return decode_status(recv_exact(self.sock, 8))

    def write(self, addr, data):
        """WRITE: header + payload in one send -> status code."""
        self.sock.sendall(encode_header(len(data), addr, OP_WRITE) + bytes(data))
        return self.status()

    def read(self, addr, size):
        """READ -> (status code, bytes or None)."""
        self.sock.sendall(encode_header(size, addr, OP_READ))
        code = self.status()
        if code != STATUS_OK:
            return code, None
        return code, recv_exact(self.sock, size)

    def closed_by_peer(self, timeout=3.0):
        """True when the peer closed (EOF or reset) within timeout."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False
