"""mooncake_driver — one real Mooncake transfer engine (the PyPI wheel's
`mooncake.engine.TransferEngine`: P2PHANDSHAKE metadata, protocol "tcp", no
device name) in its own process, driven over JSON lines on stdin/stdout, so
that a crash or a glog FATAL of the wheel cannot take pytest down.

    python3 mooncake_driver.py HOST BUFFER_BYTES SEED [METADATA]

(METADATA: the engine's metadata server, default P2PHANDSHAKE; with
"etcd://HOST:PORT" the segment is named HOST)

registers one buffer of BUFFER_BYTES filled with random.Random(SEED).randbytes
(guarded by GUARD bytes of 0xA5 on each side, not registered), prints
    {"segment": "HOST:PORT", "addr": A, "length": N, "guard": G, "pid": P}
then answers one line per command:
    {"cmd": "read",  "target": SEG, "remote": ADDR, "offset": K, "length": N}
        -> {"rc": RC, "data": HEX}   (local buffer [K, K+N) after the READ)
    {"cmd": "write", "target": SEG, "remote": ADDR, "offset": K, "data": HEX}
        -> {"rc": RC}                (local [K, ...) = data, then WRITE)
    {"cmd": "peek", "offset": K, "length": N}   (K may be negative: guards)
        -> {"data": HEX}
    {"cmd": "poke", "offset": K, "data": HEX} -> {}
EOF on stdin ends it.
"""
import ctypes
import json
import os
import random
import sys

GUARD = 4096


def main():
    host, size, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    metadata = sys.argv[4] if len(sys.argv) > 4 else "P2PHANDSHAKE"
    from mooncake.engine import TransferEngine  # ImportError: the caller skips

    raw = ctypes.create_string_buffer(size + 2 * GUARD)
    base = ctypes.addressof(raw) + GUARD
    ctypes.memset(ctypes.addressof(raw), 0xA5, size + 2 * GUARD)
    ctypes.memmove(base, random.Random(seed).randbytes(size), size)

    eng = TransferEngine()
    rc = eng.initialize(host, metadata, "tcp", "")
    if rc != 0:
        print(json.dumps({"error": f"TransferEngine.initialize returned {rc}"}), flush=True)
        return 1
    rc = eng.register_memory(base, size)
    if rc != 0:
        print(json.dumps({"error": f"register_memory returned {rc}"}), flush=True)
        return 1
    segment = f"{host}:{eng.get_rpc_port()}" if metadata == "P2PHANDSHAKE" else host
    print(json.dumps({"segment": segment, "addr": base, "length": size,
                      "guard": GUARD, "pid": os.getpid()}), flush=True)

    def peek(off, n):
        return ctypes.string_at(base + off, n)

    for line in sys.stdin:
        req = json.loads(line)
        cmd = req["cmd"]
        if cmd == "read":
            rc = eng.transfer_sync_read(req["target"], base + req["offset"], req["remote"],
                                        req["length"])
            out = {"rc": rc, "data": peek(req["offset"], req["length"]).hex()}
        elif cmd == "write":
            data = bytes.fromhex(req["data"])
            ctypes.memmove(base + req["offset"], data, len(data))
            out = {"rc": eng.transfer_sync_write(req["target"], base + req["offset"], req["remote"],
                                                 len(data))}
        elif cmd == "peek":
            out = {"data": peek(req["offset"], req["length"]).hex()}
        elif cmd == "poke":
            data = bytes.fromhex(req["data"])
            ctypes.memmove(base + req["offset"], data, len(data))
            out = {}
        else:
            out = {"error": f"unknown command {cmd!r}"}
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
