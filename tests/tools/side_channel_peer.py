"""A vLLM-shaped side-channel peer (pyzmq + msgspec, the libraries vLLM's
MooncakeConnector uses), driven by tests/unit/test_side_channel.c.

  dealer ENDPOINT   act as vLLM's decode worker: send one pull (msgspec Struct,
                    omit_defaults) to our ROUTER, read replies until FINISH/ERROR,
                    print one line per reply: STATUS ok=a,b err=c msg=...
  router            act as vLLM's prefill worker: bind a ROUTER, print its port,
                    receive one pull from our DEALER, check it decodes as vLLM's
                    MooncakeXferMetadata, reply CONTINUE(ok=first) then FINISH(ok=rest)
  router-cancel     like vLLM's prefill worker facing our cancel message: take one pull,
                    answer nothing, then decode the next message as vLLM does (a
                    MooncakeXferMetadata) and answer ERROR(str(exception)) as vLLM's
                    _sender_worker does; print "cancel answered ERROR: <msg>"
"""
import sys
from enum import IntEnum

import msgspec
import zmq


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


def dealer(endpoint):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10000)
    s.connect(endpoint)
    meta = MooncakeXferMetadata(
        remote_hostname="127.0.0.1", remote_port=12345, remote_tp_size=1, remote_tp_rank=0,
        req_blocks={"d-1": ("xfer-1", [[1, 2, 3]]), "d-2": ("xfer-2", [[4]])},
        kv_caches_base_addr=[140000000000000], block_lens=[4096], kv_block_lens=[4096])
    s.send(msgspec.msgpack.encode(meta))
    dec = msgspec.msgpack.Decoder(MooncakeXferResponse)
    while True:
        r = dec.decode(s.recv())
        print(f"{r.status.name} ok={','.join(r.ok_reqs or [])} err={','.join(r.err_reqs or [])}"
              f" msg={r.err_msg or ''}", flush=True)
        if r.status != Status.CONTINUE:
            break
    s.close()
    ctx.term()


def router():
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 1000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    if s.poll(20000) == 0:
        sys.exit("no pull arrived")
    ident, payload = s.recv_multipart()
    meta = msgspec.msgpack.Decoder(MooncakeXferMetadata).decode(payload)
    reqs = list(meta.req_blocks)
    print(f"pull host={meta.remote_hostname} port={meta.remote_port} reqs={','.join(reqs)} "
          f"blocks={meta.req_blocks[reqs[0]][1]} base={meta.kv_caches_base_addr} "
          f"pp={meta.remote_pp_size}", flush=True)
    enc = msgspec.msgpack.Encoder()
    s.send_multipart([ident, enc.encode(MooncakeXferResponse(Status.CONTINUE, ok_reqs=reqs[:1]))])
    s.send_multipart([ident, enc.encode(MooncakeXferResponse(Status.FINISH, ok_reqs=reqs[1:]))])
    s.close()
    ctx.term()


def router_cancel():
    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 1000)
    port = s.bind_to_random_port("tcp://127.0.0.1")
    print(port, flush=True)
    dec = msgspec.msgpack.Decoder(MooncakeXferMetadata)
    enc = msgspec.msgpack.Encoder()
    for i in range(2):
        if s.poll(20000) == 0:
            sys.exit("no message arrived")
        ident, payload = s.recv_multipart()
        try:
            dec.decode(payload)
            if i == 1:
                sys.exit("the second message decoded as a pull")
        except Exception as e:  # what vLLM's _sender_worker does with any error
            s.send_multipart([ident, enc.encode(MooncakeXferResponse(Status.ERROR, err_msg=str(e)))])
            print(f"cancel answered ERROR: {e}", flush=True)
    s.close()
    ctx.term()


if __name__ == "__main__":
    {"dealer": lambda: dealer(sys.argv[2]), "router": router,
     "router-cancel": router_cancel}[sys.argv[1]]()
