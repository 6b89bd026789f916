"""Golden side-channel messages from msgspec, the encoder vLLM's MooncakeConnector
uses: the Structs below restate the wire-relevant fields of vLLM's
MooncakeXferMetadata / MooncakeXferResponse (msgspec.Struct, omit_defaults=True,
map encoding).  Prints C arrays for tests/unit/test_side_channel_msg.c.
Run: python3 tests/golden/gen_side_channel_msg.py"""
from enum import IntEnum

import msgspec


class MooncakeXferMetadata(msgspec.Struct, omit_defaults=True):
    remote_hostname: str
    remote_port: int
    remote_tp_size: int
    remote_tp_rank: int
    req_blocks: dict[str, tuple[str, list[list[int]]]]
    kv_caches_base_addr: list[int]
    block_lens: list[int]
    kv_block_lens: list[int]
    registered_layer_names: list[str] = msgspec.field(default_factory=list)
    registered_layer_indices: list[int] = msgspec.field(default_factory=list)
    registered_group_indices: list[int] = msgspec.field(default_factory=list)
    remote_pp_size: int = 1


class Status(IntEnum):
    FINISH = 0
    CONTINUE = 1
    ERROR = 2


class MooncakeXferResponse(msgspec.Struct, omit_defaults=True):
    status: Status
    ok_reqs: list[str] | None = None
    err_reqs: list[str] | None = None
    err_msg: str | None = None


def c_array(name, data):
    body = ", ".join(f"0x{b:02x}" for b in data)
    return f"static const unsigned char {name}[{len(data)}] = {{{body}}};"


enc = msgspec.msgpack.Encoder()
pull_min = MooncakeXferMetadata(
    remote_hostname="10.0.0.3", remote_port=17001, remote_tp_size=1, remote_tp_rank=0,
    req_blocks={"cmpl-1": ("xfer-a", [[3, 4, 5, 200, 70000]]), "cmpl-2": ("xfer-b", [])},
    kv_caches_base_addr=[0x7F0000001000], block_lens=[1835008], kv_block_lens=[1835008])
pull_full = MooncakeXferMetadata(
    remote_hostname="decode-host", remote_port=65535, remote_tp_size=4, remote_tp_rank=3,
    req_blocks={"r": ("x", [[0], [1, 2]])},
    kv_caches_base_addr=[2**64 - 1, 0], block_lens=[4096, 8192], kv_block_lens=[2048, 8192],
    registered_layer_names=["model.layers.0.self_attn", "model.layers.1.self_attn"],
    registered_layer_indices=[0, 1], registered_group_indices=[0, -1], remote_pp_size=2)
reply_finish = MooncakeXferResponse(status=Status.FINISH, ok_reqs=["cmpl-1", "cmpl-2"])
reply_error = MooncakeXferResponse(status=Status.ERROR, err_reqs=["cmpl-3"],
                                   err_msg="Timeout waiting for P side ready.")
reply_continue = MooncakeXferResponse(status=Status.CONTINUE)
for name, obj in [("GOLDEN_PULL_MIN", pull_min), ("GOLDEN_PULL_FULL", pull_full),
                  ("GOLDEN_REPLY_FINISH", reply_finish), ("GOLDEN_REPLY_ERROR", reply_error),
                  ("GOLDEN_REPLY_CONTINUE", reply_continue)]:
    print(c_array(name, enc.encode(obj)))
