#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets (fuzz/corpus/<name>/): small,
real examples of each input -- the golden msgpack messages of
tests/golden (msgspec/vLLM's encoder), the tiny model's config and a reduced
copy of its tokenizer.json, requests as the OpenAI client sends them, the
bootstrap and transfer wire formats of PROTOCOL.md / docs/transfer.md.
Re-run after changing it: python3 tools/gen_fuzz_corpus.py"""
import json
import os
import re
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fuzz", "corpus")
TINY = os.path.join(ROOT, "models", "disagg-sotu-tiny")


def put(name, seeds):
    d = os.path.join(OUT, name)
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    for i, s in enumerate(seeds):
        if isinstance(s, str):
            s = s.encode()
        with open(os.path.join(d, "seed-%02d" % i), "wb") as f:
            f.write(s)


def js(o):
    return json.dumps(o, separators=(",", ":"))


# ---- kv_transfer_config ----
put("kv_transfer_config", [
    js({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer"}),
    js({"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute", "engine_id": "d-0"}),
    js({"kv_connector": "MooncakeConnector", "kv_role": "kv_both", "kv_buffer_device": "cuda",
        "kv_port": 14579, "kv_rank": 0, "kv_parallel_size": 1,
        "kv_connector_extra_config": {"num_workers": 4, "mooncake_protocol": "tcp",
                                      "device_name": "eth0,eth1",
                                      "bootstrap_server_address": "10.0.0.2:8998",
                                      "other_option": True}}),
    js({"kv_connector": "MooncakeConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "shm",
                                      "bootstrap_server_address": "[::1]:8998"}}),
    "{'kv_role':'kv_producer'}",
    js({"kv_connector": "MoonCakeConector", "kv_role": "kv_prodcer", "kv_rank": 1.5}),
])

# ---- model_config: config.json [NUL generation_config.json] ----
cfg = open(os.path.join(TINY, "config.json"), "rb").read()
gen = open(os.path.join(TINY, "generation_config.json"), "rb").read()
c4 = json.loads(cfg)
c4["torch_dtype"] = c4.pop("dtype")
c4["rope_theta"] = c4.pop("rope_parameters")["rope_theta"]
c4["eos_token_id"] = [4093, 4095]
put("model_config", [cfg, cfg + b"\0" + gen, js(c4).encode(),
                     js({"model_type": "qwen2", "vocab_size": 8, "hidden_size": 8,
                         "num_hidden_layers": 1, "num_attention_heads": 2,
                         "intermediate_size": 16, "head_dim": 4,
                         "rope_scaling": {"rope_type": "yarn", "factor": 4}}).encode()
                     + b"\0" + js({"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                   "repetition_penalty": 1.05, "eos_token_id": [1, 2]}).encode()])

# ---- side_channel_msg: the golden msgpack of tests/golden ----
gold = open(os.path.join(ROOT, "tests", "golden", "side_channel_msg_golden.h")).read()
seeds = []
for m in re.finditer(r"static const unsigned char (\w+)\[(\d+)\] = \{([^}]*)\}", gold):
    seeds.append(bytes(int(x, 16) for x in re.findall(r"0x([0-9a-fA-F]{2})", m.group(3))))
assert seeds, "no golden messages found"
put("side_channel_msg", seeds)

# ---- segment_desc: [9-byte handshake header] descriptor JSON ----
desc = {"name": "127.0.0.1:40123", "protocol": "tcp", "tcp_data_port": 40124,
        "tcp_proto_version": 2,
        "buffers": [{"name": "cpu:0", "addr": 140234234, "length": 67108864},
                    {"name": "cuda:0", "addr": 240234234, "length": 4096}],
        "timestamp": "2026-11-29T09:00:00Z",
        "disagg": {"version": 1, "host_id": "0b7c/4026531836", "pid": 1234,
                   "data_addrs": ["10.0.0.2:40124", "[fe80::1]:40124"]}}
mooncake = {"name": "10.0.0.3:12001", "protocol": "tcp", "tcp_data_port": 15001,
            "buffers": [{"name": "cpu:0", "addr": 4096, "length": 1 << 20}]}


def frame(body, t=1):
    return struct.pack("<QB", len(body), t) + body


put("segment_desc", [js(desc), js(mooncake), frame(js(desc).encode()),
                     frame(b'{"status":"ok"}', 3)])

# ---- bootstrap_table: GET /query answers ----
put("bootstrap_table", [
    js({"0": {"engine_id": "p-0", "worker_addr": {"0": {"0": "tcp://10.0.0.2:53817"}}}}),
    js({"0": {"engine_id": "p-0", "worker_addr": {"0": {"0": "tcp://10.0.0.2:1"},
                                                  "1": {"0": "tcp://10.0.0.2:2", "1": "tcp://10.0.0.2:3"}}},
        "3": {"engine_id": "p-3", "worker_addr": {"2": {"0": "tcp://[::1]:4"}}}}),
    "{}",
])

# ---- bootstrap_server: byte0 even = raw HTTP, odd = POST /register body ----
reg = js({"engine_id": "p-0", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://10.0.0.2:53817"})
put("bootstrap_server", [
    b"\0GET /query HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\0POST /register HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(reg), reg.encode()),
    b"\0POST /register HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n2\r\n1}\r\n0\r\n\r\n",
    b"\0DELETE /query?x=1 HTTP/1.0\r\n\r\n",
    b"\1" + reg.encode(),
    b"\1" + js({"engine_id": "p-1", "dp_rank": 1, "tp_rank": 2, "pp_rank": 0, "addr": "tcp://[::1]:9"}).encode(),
    b"\1" + js({"engine_id": 5, "dp_rank": "0", "tp_rank": -1}).encode(),
    b"\1[1,2]",
])

# ---- handshake_server: frames ----
put("handshake_server", [frame(b"{}"), frame(js(desc).encode()), frame(b"", 1), frame(b"", 3),
                         frame(b"{}", 0), struct.pack("<QB", 1 << 30, 1)])

# ---- tcp_data: header addr = offset into the registered buffer ----
def hdr(size, off, op):
    return struct.pack("<QQB7x", size, off, op)


put("tcp_data", [
    hdr(16, 0, 0x81) + bytes(range(16)) + hdr(16, 0, 0x80),
    hdr(8, 65528, 0x81) + b"ABCDEFGH" + hdr(9, 65528, 0x80) + hdr(0, 0, 0x80),
    hdr(4, 100, 0x81) + b"xy",
    hdr(16, 1 << 40, 0x81) + bytes(16) + hdr(1, 0, 0x02),
])

# ---- openai_request: byte0 even = completions, odd = chat ----
put("openai_request", [
    b"0" + js({"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 16, "temperature": 0}).encode(),
    b"0" + js({"prompt": [[1, 2, 3], [4093]], "n": 2, "logprobs": 3, "echo": True, "stop": ["\n", "."],
               "stream": True, "stream_options": {"include_usage": True}, "seed": 7,
               "kv_transfer_params": {"do_remote_decode": True}}).encode(),
    b"0" + js({"prompt": ["a", "b"], "top_p": 0.9, "top_k": 5, "min_p": 0.1, "stop_token_ids": [4095],
               "prompt_logprobs": 1, "repetition_penalty": 1.1, "ignore_eos": True,
               "min_tokens": 2}).encode(),
    b"1" + js({"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hi \u00e9\u4f60"}],
               "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2}).encode(),
    b"1" + js({"messages": [{"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                            {"role": "assistant", "content": None, "tool_calls": [
                                {"id": "c1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
                            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
               "tools": [{"type": "function", "function": {
                   "name": "get_weather", "description": "Weather",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}],
               "tool_choice": "auto", "stream": True}).encode(),
    b"1" + js({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": False,
               "continue_final_message": False, "n": 3, "stop": "<tool_call>"}).encode(),
])

# ---- tokenizer_encode: prompt text ----
put("tokenizer_encode", [
    "Hello world! The quick brown fox.",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "  multiple   spaces\tand\ttabs\n\n\nnew lines 123456789 don't I'M we'll",
    "caf\u00e9 \u4f60\u597d \U0001F600 e\u0301 \ufb01",
    b"bad \xff utf8 \xc3",
])

# ---- tokenizer_json: a reduced tokenizer.json [NUL tokenizer_config.json] ----
tj = json.load(open(os.path.join(TINY, "tokenizer.json")))
vocab = tj["model"]["vocab"]
keep = {k: v for k, v in vocab.items() if v < 300}
merges = []
for m in tj["model"]["merges"]:
    a, b = m if isinstance(m, list) else m.split(" ", 1)
    if a in keep and b in keep and a + b in keep:
        merges.append(m)
small = dict(tj)
small["model"] = dict(tj["model"], vocab=keep, merges=merges)
small["added_tokens"] = [dict(t, id=300 + i) for i, t in enumerate(tj["added_tokens"])]
tc = json.load(open(os.path.join(TINY, "tokenizer_config.json")))
tc_small = {"add_bos_token": False, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "model_max_length": 2048, "bos_token": None,
            "added_tokens_decoder": {str(300 + i): dict(t) for i, t in enumerate(tj["added_tokens"])}}
tjs = js(small).encode()
put("tokenizer_json", [tjs, tjs + b"\0" + js(tc_small).encode(),
                       js(dict(small, normalizer=None, pre_tokenizer={"type": "ByteLevel", "add_prefix_space": False, "use_regex": True})).encode()])

# ---- safetensors: byte0 even = model.safetensors; odd = index NUL shard ----
def st(tensors, meta=None):
    h, data, off = {}, b"", 0
    if meta:
        h["__metadata__"] = meta
    for name, (dt, shape, raw) in tensors.items():
        h[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    hj = js(h).encode()
    return struct.pack("<Q", len(hj)) + hj + data


one = st({"model.embed_tokens.weight": ("BF16", [2, 3], bytes(12)),
          "model.norm.weight": ("F32", [3], struct.pack("<3f", 1, 2, 3))}, {"format": "pt"})
idx = js({"metadata": {"total_size": 24},
          "weight_map": {"model.embed_tokens.weight": "model-00001-of-00001.safetensors",
                         "model.norm.weight": "model-00001-of-00001.safetensors"}}).encode()
put("safetensors", [b"\0" + one, b"\1" + idx + b"\0" + one,
                    b"\0" + st({"a": ("F16", [], bytes(2)), "b": ("I64", [1, 1, 1, 1], bytes(8))})])
# ---- proxy_http: byte0 bit0 request / bit1 HEAD response, byte1 piece size ----
body = js({"model": "tiny", "prompt": "Hi", "max_tokens": 4}).encode()
put("proxy_http", [
    b"\x01\x07POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(body), body),
    b"\x01\x00\r\nGET /v1/models HTTP/1.0\nConnection: keep-alive\n\n",
    b"\x01\x03POST /v1/chat/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
    b"5;ext=1\r\nhello\r\n0\r\nX-Trailer: 1\r\n\r\n",
    b"\x00\x10HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"e\r\ndata: {\"a\":1}\n\n\r\n0\r\n\r\n",
    b"\x00\xffHTTP/1.1 503 Service Unavailable\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    b"\x02\x05HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n",
    b"\x00\x01HTTP/1.0 200 OK\r\n\r\nuntil close",
])

# ---- proxy_pd_request: byte0 even = client body, odd = bootstrap /query table ----
put("proxy_pd_request", [
    b"0" + js({"model": "tiny", "prompt": "Hello", "max_tokens": 16, "stream": True,
               "stream_options": {"include_usage": True}, "min_tokens": 2}).encode(),
    b"0" + js({"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 5,
               "kv_transfer_params": {"x": 1}}).encode(),
    b"0[]",
    b"1" + js({"0": {"engine_id": "p-0", "worker_addr": {"0": {"0": "tcp://10.0.0.2:53817"}}}}).encode(),
    b"1" + js({"1": {"engine_id": "p-1", "worker_addr": {"0": {"0": "a"}, "3": {"0": "b"}}},
               "0": {"engine_id": "p-0", "worker_addr": {}}}).encode(),
    b"1{}",
])
# ---- server_http: byte0 even = raw HTTP; odd = byte1 route (0 completions,
# 1 chat, 2 tokenize, 3 detokenize) + POST body ----
put("server_http", [
    b"\x01\x00" + js({"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode(),
    b"\x01\x00" + js({"prompt": [1, 2, 3], "max_tokens": 3, "stream": True, "logprobs": 2,
                       "echo": True, "stream_options": {"include_usage": True}}).encode(),
    b"\x01\x01" + js({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                       "stream": True, "logprobs": True, "top_logprobs": 1}).encode(),
    b"\x01\x01" + js({"messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 4,
                       "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}]}).encode(),
    b"\x01\x02" + js({"prompt": "Hello world"}).encode(),
    b"\x01\x02" + js({"messages": [{"role": "user", "content": "x"}]}).encode(),
    b"\x01\x03" + js({"tokens": [1, 2, 4093]}).encode(),
    b"\x00GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n",
    b"\x00GET /metrics HTTP/1.1\r\n\r\n",
    b"\x00POST /v1/completions HTTP/1.1\r\nAuthorization: Bearer x\r\nContent-Length: 2\r\n\r\n{}",
])
print("fuzz corpora written to", OUT)

# ---- discovery: byte0 even = an etcd instance record, odd = a --discovery URL ----
put("discovery", [
    b"\0" + js({"role": "prefill", "url": "http://10.0.0.1:8100", "bootstrap": "http://10.0.0.1:8998",
                "model": "tiny", "engine_id": "8f2d1394-6244-48bb-abf8-5f2cc5796469",
                "kv_layout": "Qwen2ForCausalLM:layers=6:kv_heads=2:head_dim=32:dtype=auto:block=16",
                "load": {"running": 1, "waiting": 0, "kv_usage": 0.25}, "pid": 1, "hostname": "p0"}).encode(),
    b"\0" + js({"role": "decode", "url": "http://[::1]:8200", "load": {}}).encode(),
    b"\0{\"role\":\"bootstrap\",\"url\":\"http://h:8998\"}",
    b"\1etcd://127.0.0.1:2379,10.0.0.2:2379/prod",
    b"\1etcds://[::1]:2379/",
    b"\1etcd://h:1,,g:2/x y",
])
