"""`disagg proxy` against upstream test doubles: the request rewriting of
PROTOCOL.md section 1, the relay, discovery, errors and cancellation."""
import http.client
import json
import os
import socket
import threading
import time

import concurrent.futures

import openai
import pytest
import requests

from proxy_fixtures import (UUID4, assert_openai_error, free_port, json_body, proxy_factory,  # noqa: F401
                            doubles, raw_request, sent, split_response, BIN)


def cf_pool():
    return concurrent.futures.ThreadPoolExecutor(1)


def pd(doubles, proxy_factory, extra=(), **kw):
    p = doubles("prefill", "p0")
    d = doubles("decode", "d0")
    return p, d, proxy_factory([p], [d], extra, **kw)


# --- request rewriting (PROTOCOL.md section 1) ------------------------------------


def test_completion_bodies_and_headers_per_protocol(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    client_body = {"model": "m", "prompt": "Hello there", "max_tokens": 7, "temperature": 0,
                   "seed": 3, "logprobs": None, "stop": ["\n"]}
    r = requests.post(px.url + "/v1/completions", json=client_body,
                      headers={"Authorization": "Bearer client-key"})
    assert r.status_code == 200, r.text
    [pr], [dr] = p.completions(), d.completions()
    pb, db = json_body(pr), json_body(dr)
    tid = pb["kv_transfer_params"]["transfer_id"]
    assert tid.startswith("xfer-") and UUID4.match(tid[5:]), tid
    expect_p = dict(client_body, max_tokens=1, stream=False,
                    kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                        "transfer_id": tid})
    assert pb == expect_p
    expect_d = dict(client_body, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": p.engine_id(0),
        "remote_bootstrap_addr": f"http://127.0.0.1:{p.bootstrap_port}", "transfer_id": tid})
    assert db == expect_d
    assert pr["path"] == dr["path"] == "/v1/completions"
    assert UUID4.match(pr["headers"]["x-request-id"])
    assert pr["headers"]["x-data-parallel-rank"] == "0"
    assert pr["headers"]["authorization"] == dr["headers"]["authorization"] == "Bearer client-key"
    # the client gets the decode answer, byte for byte
    assert r.content == sent(dr)
    assert r.headers["content-type"] == "application/json"
    assert r.headers["x-double"] == "d0"  # end-to-end headers of D's answer are relayed


def test_chat_stream_bodies_stream_options_and_max_completion_tokens(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    client_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "max_completion_tokens": 4, "max_tokens": 4, "stream": True,
                   "stream_options": {"include_usage": True}, "min_tokens": 2}
    r = requests.post(px.url + "/v1/chat/completions", json=client_body, stream=True)
    raw = b"".join(r.iter_content(None))
    assert r.status_code == 200
    pb, db = json_body(p.completions()[0]), json_body(d.completions()[0])
    assert "stream_options" not in pb
    assert "min_tokens" not in pb  # a 1-token prefill cannot honour it (D still gets it)
    assert pb["stream"] is False and pb["max_tokens"] == 1 and pb["max_completion_tokens"] == 1
    assert pb["messages"] == client_body["messages"]
    kv = db.pop("kv_transfer_params")
    assert db == client_body
    assert kv["transfer_id"] == pb["kv_transfer_params"]["transfer_id"]
    assert raw == sent(d.completions()[0])
    assert b'"usage"' in raw and raw.endswith(b"data: [DONE]\n\n")


def test_max_completion_tokens_absent_stays_absent(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    r = requests.post(px.url + "/v1/chat/completions",
                      json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 200
    pb = json_body(p.completions()[0])
    assert "max_completion_tokens" not in pb and pb["max_tokens"] == 1
    assert "max_tokens" not in json_body(d.completions()[0])


def test_api_key_flag_checked_and_forwarded(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, extra=["--api-key", "sk-upstream"])
    r = requests.post(px.url + "/v1/completions", json={"prompt": "a"},
                      headers={"Authorization": "Bearer from-client"})
    assert r.status_code == 401  # test_proxy_args.py covers the check
    assert not p.completions() and not d.completions()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "a"},
                      headers={"Authorization": "Bearer sk-upstream"})
    assert r.status_code == 200
    for rec in (p.completions()[0], d.completions()[0]):
        assert rec["headers"]["authorization"] == "Bearer sk-upstream"


def test_bootstrap_given_as_address_and_url(doubles, proxy_factory):
    for form in ("addr", "url"):
        p = doubles("prefill", f"p-{form}")
        d = doubles("decode", f"d-{form}")
        px = proxy_factory([p], [d], bootstrap_arg=form)
        r = requests.post(px.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 200
        kv = json_body(d.completions()[0])["kv_transfer_params"]
        assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{p.bootstrap_port}"
        assert kv["remote_engine_id"] == p.engine_id(0)


# --- relay ----------------------------------------------------------------------------


def test_streaming_relay_byte_for_byte_raw_http(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    d.stream_events = 20
    d.stream_interval = 0.01
    conn = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)
    body = json.dumps({"prompt": "stream me", "stream": True, "max_tokens": 20})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type") == "text/event-stream; charset=utf-8"
    assert resp.getheader("Transfer-Encoding") == "chunked"
    # events arrive as the decode sends them, not all at the end
    first = resp.read1(65536)
    assert first.startswith(b"data: ")
    rest = resp.read()
    assert first + rest == sent(d.completions()[0])
    assert (first + rest).count(b"data: ") == 21
    # keep-alive: a second request on the same connection works
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b'{"status":"ok"}'
    conn.close()


def test_stream_reaches_client_before_decode_ends(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    d.stream_events = 10
    d.stream_interval = 0.1
    t0 = time.monotonic()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 10},
                      stream=True)
    it = r.iter_lines()
    first = next(l for l in it if l)
    t_first = time.monotonic() - t0
    list(it)
    t_all = time.monotonic() - t0
    assert first.startswith(b"data: ")
    assert t_first < 0.5 and t_all > 0.9, (t_first, t_all)


def test_openai_client_same_answers_as_the_decode_instance(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    via = openai.OpenAI(base_url=px.url + "/v1", api_key="k", max_retries=0)
    direct = openai.OpenAI(base_url=d.url + "/v1", api_key="k", max_retries=0)
    for c in (via, direct):
        assert [m.id for m in c.models.list()] == ["double-model"]
    kw = dict(model="double-model", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert via.completions.create(**kw).choices[0].text == direct.completions.create(**kw).choices[0].text
    s_via = "".join(ch.choices[0].text for ch in via.completions.create(stream=True, **kw))
    s_dir = "".join(ch.choices[0].text for ch in direct.completions.create(stream=True, **kw))
    assert s_via == s_dir and s_via
    msgs = [{"role": "user", "content": "Say hi"}]
    ckw = dict(model="double-model", messages=msgs, max_tokens=4, temperature=0)
    assert (via.chat.completions.create(**ckw).choices[0].message.content ==
            direct.chat.completions.create(**ckw).choices[0].message.content)
    parts = [ch.choices[0].delta.content or "" for ch in via.chat.completions.create(stream=True, **ckw)
             if ch.choices]
    parts_d = [ch.choices[0].delta.content or "" for ch in direct.chat.completions.create(stream=True, **ckw)
               if ch.choices]
    assert parts == parts_d and "".join(parts)


def _warm(p, d, px):
    # warm up: the proxy then holds keep-alive connections to P and D, so each upstream
    # request is on its socket at once (one cancelled while still connecting never arrives)
    assert requests.post(px.url + "/v1/completions", json={"prompt": "w"}).status_code == 200
    p.clear()
    d.clear()


def _wait_done(double, timeout=5):
    deadline = time.monotonic() + timeout
    while not double.completions() and time.monotonic() < deadline:
        time.sleep(0.01)
    rec = double.completions()[0]
    assert rec["done"].wait(timeout)
    return rec


def test_decode_error_waits_for_the_prefill_verdict_then_is_relayed(doubles, proxy_factory):
    """D rejects while P is still working: the client gets D's answer unchanged, but only
    once P answered 2xx (P's verdict comes first)."""
    p, d, px = pd(doubles, proxy_factory)
    _warm(p, d, px)
    p.hold = True
    d.fail_status = 400
    with cf_pool() as ex:
        fut = ex.submit(requests.post, px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        _wait_done(d)  # D has answered 400
        time.sleep(0.3)
        assert not fut.done(), "the decode's error was relayed before the prefill's verdict"
        p.release()
        r = fut.result()
    assert r.status_code == 400
    assert r.content == sent(d.completions()[0])
    assert px.metrics()['disagg_proxy_errors_total{reason="decode_rejected"}'] == 1


def test_prefill_4xx_is_relayed_unchanged_and_decode_cancelled(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    _warm(p, d, px)
    d.hold = True  # a decode that would wait for KV that never comes
    p.fail_status = 422
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 422, r.text
    assert r.content == sent(p.completions()[0])
    assert r.headers["Content-Type"] == "application/json"
    assert "injected failure on p0" in r.json()["error"]["message"]
    rec = _wait_done(d)
    assert rec["peer_closed"], "the decode request was not cancelled"
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="prefill_rejected"}'] == 1
    assert m['disagg_proxy_responses_total{code="4xx"}'] == 1


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_both_reject_client_gets_the_prefills_status_in_either_order(doubles, proxy_factory, first):
    p, d, px = pd(doubles, proxy_factory)
    _warm(p, d, px)
    p.fail_status, d.fail_status = 400, 422
    later = d if first == "prefill" else p
    earlier = p if first == "prefill" else d
    later.hold = True
    with cf_pool() as ex:
        fut = ex.submit(requests.post, px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        _wait_done(earlier)
        time.sleep(0.2)
        later.release()
        r = fut.result()
    assert r.status_code == 400, r.text
    assert r.content == sent(p.completions()[0])


def test_n_and_best_of_prefill_copy_drops_best_of(doubles, proxy_factory):
    """P's copy has n 1, so best_of (D's: it generates the best_of sequences) goes
    too; D gets both unchanged."""
    p, d, px = pd(doubles, proxy_factory)
    body = {"model": "m", "prompt": "x", "max_tokens": 3, "n": 2, "best_of": 2}
    r = requests.post(px.url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    pb, db = json_body(p.completions()[0]), json_body(d.completions()[0])
    assert pb["n"] == 1 and "best_of" not in pb, pb
    db.pop("kv_transfer_params")
    assert db == body


BAD_BODIES = [  # (path, body, param, words in the message): what P's copy rewrites, and the prompt
    ("/v1/completions", {"prompt": "x", "n": 0}, "n", ["'n'", "got 0"]),
    ("/v1/completions", {"prompt": "x", "n": -3}, "n", ["'n'", "got -3"]),
    ("/v1/completions", {"prompt": "x", "n": 1.5}, "n", ["'n'", "a number"]),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n", ["'n'", "a string"]),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 1}, "best_of", ["'best_of'", "(2)"]),
    ("/v1/completions", {"prompt": "x", "n": 2, "best_of": 3, "stream": True}, "best_of",
     ["'best_of'", "cannot be streamed"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", ["'max_tokens'", "got 0"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens", ["'max_tokens'", "got -1"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.5}, "max_tokens", ["'max_tokens'", "a number"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": [4]}, "max_tokens", ["'max_tokens'", "an array"]),
    ("/v1/completions", {"prompt": "x", "max_tokens": 3, "min_tokens": 5}, "min_tokens",
     ["'min_tokens' (5)", "max_tokens (3)"]),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", ["'stream'", "boolean"]),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     ["'stream_options'", "'stream' is true"]),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": 1}, "stream_options",
     ["'stream_options'", "object"]),
    ("/v1/completions", {"prompt": "x", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs",
     ["'prompt_logprobs'", "'stream'"]),
    ("/v1/completions", {"max_tokens": 3}, "prompt", ["'prompt' is required"]),
    ("/v1/completions", {"prompt": None}, "prompt", ["'prompt' is required"]),
    ("/v1/completions", {"prompt": 5}, "prompt", ["'prompt' must be", "an integer"]),
    ("/v1/chat/completions", {"prompt": "x"}, "messages", ["'messages' is required"]),
    ("/v1/chat/completions", {"messages": []}, "messages", ["'messages'", "an empty list"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 9,
                              "max_completion_tokens": 0}, "max_completion_tokens",
     ["'max_completion_tokens'", "got 0"]),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 2, "min_tokens": 3}, "min_tokens",
     ["'min_tokens' (3)", "max_tokens (2)"]),
]


@pytest.mark.parametrize("path,body,param,words", BAD_BODIES,
                         ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_BODIES)])
def test_invalid_fields_refused_before_contacting_any_instance(doubles, proxy_factory, path, body,
                                                               param, words):
    """What P's copy rewrites cannot be refused by P; a D refusing it left P
    holding the KV.  The proxy refuses it itself, with disagg serve's 400 body shape."""
    p, d, px = pd(doubles, proxy_factory)
    r = requests.post(px.url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "BadRequestError" and err["code"] == 400 and err["param"] == param, err
    for w in words:
        assert w in err["message"], err["message"]
    assert not p.completions() and not d.completions(), "an instance was contacted"
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="bad_request"}'] == 1
    assert m[f'disagg_proxy_backend_requests_total{{role="prefill",backend="{p.url}"}}'] == 0


@pytest.mark.parametrize("body", [
    {"prompt": "x", "n": 2, "best_of": 2, "max_tokens": 2, "min_tokens": 2},
    {"prompt": [1, 2, 3], "n": 2.0, "max_tokens": 4.0, "stream": True, "stream_options": None},
    {"prompt": "x", "stream": False, "stream_options": None, "prompt_logprobs": 1, "n": None},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "max_completion_tokens": 5,
     "min_tokens": 4, "stream": True, "stream_options": {"include_usage": True}},
], ids=["n-best_of-min", "floats-null-options", "prompt_logprobs-no-stream", "chat-mct-wins"])
def test_valid_fields_pass_the_proxys_checks(doubles, proxy_factory, body):
    p, d, px = pd(doubles, proxy_factory)
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = requests.post(px.url + path, json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert len(p.completions()) == len(d.completions()) == 1


# --- errors are not lost ------------------------------------------------------------


def test_decode_5xx_is_relayed_at_once_and_prefill_cancelled(doubles, proxy_factory):
    """D failed (5xx): the client need not wait for a P that may never
    answer; P's request is cancelled."""
    p, d, px = pd(doubles, proxy_factory)
    _warm(p, d, px)
    p.hold = True
    d.fail_status = 500
    t0 = time.monotonic()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    took = time.monotonic() - t0
    assert r.status_code == 500, r.text
    assert r.content == sent(d.completions()[0])
    assert took < 3, took
    rec = _wait_done(p)
    assert rec["peer_closed"], "the prefill request was not cancelled"
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="decode_rejected"}'] == 1
    assert m[f'disagg_proxy_backend_outstanding_requests{{role="prefill",backend="{p.url}"}}'] == 0


@pytest.mark.parametrize("decode_answered", [False, True])
def test_prefill_that_stops_answering_ends_the_wait(doubles, proxy_factory, decode_answered):
    """A prefill whose health probes go unanswered (a stopped process) is
    given up: the requests waiting for it get D's complete answer (D rejected) or a 502 naming
    it within seconds, not at the upstream timeout."""
    p, d, px = pd(doubles, proxy_factory)
    _warm(p, d, px)
    p.hold = True
    if decode_answered:
        d.fail_status = 400
    else:
        d.hold = True  # D waits for KV that never comes
    with cf_pool() as ex:
        fut = ex.submit(requests.post, px.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
        deadline = time.monotonic() + 5
        while not (p.completions() and d.completions()) and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        p.health_hang = True
        r = fut.result()
        took = time.monotonic() - t0
    p.health_hang = False
    print(f"client answered {took:.2f} s after the prefill stopped answering")
    assert took < 10, took
    if decode_answered:
        assert r.status_code == 400 and r.content == sent(d.completions()[0])
    else:
        err = assert_openai_error(r, 502, "prefill", p.url, "stopped answering")
        assert "health probes" in err["message"]
        rec = _wait_done(d)
        assert rec["peer_closed"], "the decode request was not cancelled"
    assert _wait_done(p)["peer_closed"], "the prefill request was not cancelled"
    # the proxy stays up, and serves again once the prefill answers again
    p.hold = d.hold = False
    p.fail_status = d.fail_status = 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = requests.post(px.url + "/v1/completions", json={"prompt": "y"}, timeout=10)
        if r.status_code == 200:
            break
        time.sleep(0.1)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("fault", ["http500", "close"])
def test_prefill_failure_gives_502_and_aborts_decode(doubles, proxy_factory, fault):
    p, d, px = pd(doubles, proxy_factory)
    # warm up: with a keep-alive connection to D in the pool the decode request reaches D at
    # once (one cancelled while still connecting never reaches it: nothing to abort there)
    assert requests.post(px.url + "/v1/completions", json={"prompt": "w"}).status_code == 200
    p.clear()
    d.clear()
    d.hold = True  # a decode that would wait for KV that never comes
    if fault == "http500":
        p.fail_status = 500
    else:
        p.close_connection = True
    t0 = time.monotonic()
    r = requests.post(px.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "x"}], "stream": True}, timeout=10)
    assert time.monotonic() - t0 < 3
    err = assert_openai_error(r, 502, "prefill", p.url)
    if fault == "http500":
        assert "HTTP 500" in err["message"] and "injected failure on p0" in err["message"]
    deadline = time.monotonic() + 5
    while not d.completions() and time.monotonic() < deadline:
        time.sleep(0.01)
    rec = d.completions()[0]
    assert rec["done"].wait(5) and rec["peer_closed"], "the decode request was not aborted"
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="prefill_failed"}'] == 1
    assert m[f'disagg_proxy_backend_outstanding_requests{{role="decode",backend="{d.url}"}}'] == 0


def test_client_disconnect_cancels_both_upstream_requests(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    p.hold = d.hold = True
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", px.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 5
    while not (p.completions() and d.completions()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert p.completions() and d.completions()
    px.wait_metric("disagg_proxy_inflight_requests", 1)
    s.close()
    for rec in (p.completions()[0], d.completions()[0]):
        assert rec["done"].wait(5), "upstream request still open after the client left"
        assert rec["peer_closed"]
    px.wait_metric('disagg_proxy_errors_total{reason="client_disconnected"}', 1)
    m = px.metrics()
    assert m["disagg_proxy_inflight_requests"] == 0
    assert m[f'disagg_proxy_backend_outstanding_requests{{role="prefill",backend="{p.url}"}}'] == 0


def test_client_disconnect_mid_stream_cancels_decode(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    d.stream_events = 50
    d.stream_interval = 0.05
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 50},
                      stream=True)
    it = r.iter_lines()
    assert next(l for l in it if l).startswith(b"data: ")
    r.close()
    rec = d.completions()[0]
    assert rec["done"].wait(5) and rec["peer_closed"]
    assert sent(rec).count(b"data: ") < 50


# --- discovery and readiness ------------------------------------------------------------


def test_503_until_discovery_then_ready(doubles, proxy_factory):
    p = doubles("prefill", "p0")
    d = doubles("decode", "d0")
    p.health_status = 503
    px = proxy_factory([p], [d], ready=False)
    time.sleep(0.3)
    for path, method in (("/health", "GET"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
        r = requests.request(method, px.url + path, json={"prompt": "x"} if method == "POST" else None)
        assert_openai_error(r, 503, "not ready", p.url)
    assert not p.completions() and not d.completions()
    # healthy but nothing registered with the bootstrap server yet: still 503
    p.query_empty = True
    p.health_status = 200
    time.sleep(0.3)
    assert_openai_error(requests.get(px.url + "/health"), 503, "empty")
    p.query_empty = False
    px.wait_ready(5)
    assert requests.post(px.url + "/v1/completions", json={"prompt": "x"}).status_code == 200
    assert px.metrics()['disagg_proxy_backend_dp_ranks{role="prefill",backend="%s"}' % p.url] == 1


def test_decode_down_at_start_is_503(doubles, proxy_factory):
    p = doubles("prefill", "p0")
    d = doubles("decode", "d0")
    d.stop()
    px = proxy_factory([p], [d], ready=False)
    time.sleep(0.3)
    assert_openai_error(requests.get(px.url + "/health"), 503, "decode", d.url)
    d.start()
    px.wait_ready(5)


# --- several instances, policies --------------------------------------------------------------


def test_round_robin_over_prefill_dp_ranks_and_decodes(doubles, proxy_factory):
    p0 = doubles("prefill", "p0", dp_ranks=2)
    p1 = doubles("prefill", "p1", dp_ranks=1)
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    px = proxy_factory([p0, p1], [d0, d1], ["--policy", "round_robin"])
    for i in range(6):
        assert requests.post(px.url + "/v1/completions", json={"prompt": str(i)}).status_code == 200
    slots = []
    for p in (p0, p1):
        for rec in p.completions():
            slots.append((p.name, rec["headers"]["x-data-parallel-rank"]))
    assert sorted(slots) == sorted([("p0", "0"), ("p0", "1"), ("p1", "0")] * 2)
    assert len(d0.completions()) == len(d1.completions()) == 3
    # every decode request names the engine and bootstrap of the prefill its twin went to
    by_tid = {}
    for p in (p0, p1):
        for rec in p.completions():
            by_tid[json_body(rec)["kv_transfer_params"]["transfer_id"]] = (p, rec["headers"]["x-data-parallel-rank"])
    for d in (d0, d1):
        for rec in d.completions():
            kv = json_body(rec)["kv_transfer_params"]
            p, rank = by_tid[kv["transfer_id"]]
            assert kv["remote_engine_id"] == p.engine_id(int(rank))
            assert kv["remote_bootstrap_addr"] == f"http://127.0.0.1:{p.bootstrap_port}"


def test_least_loaded_picks_the_idle_instances(doubles, proxy_factory):
    p0, p1 = doubles("prefill", "p0"), doubles("prefill", "p1")
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    px = proxy_factory([p0, p1], [d0, d1])  # default policy
    for x in (p0, p1, d0, d1):
        x.hold = True
    results = []
    threads = [threading.Thread(target=lambda: results.append(
        requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=20).status_code))
        for _ in range(2)]
    threads[0].start()
    deadline = time.monotonic() + 5
    while len(p0.completions()) + len(p1.completions()) < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads[1].start()
    while len(p0.completions()) + len(p1.completions()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    while len(d0.completions()) + len(d1.completions()) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # the second request went to the instances the first one did not occupy
    assert len(p0.completions()) == len(p1.completions()) == 1
    assert len(d0.completions()) == len(d1.completions()) == 1
    m = px.metrics()
    for x, role in ((p0, "prefill"), (p1, "prefill"), (d0, "decode"), (d1, "decode")):
        assert m[f'disagg_proxy_backend_outstanding_requests{{role="{role}",backend="{x.url}"}}'] == 1
    for x in (p0, p1, d0, d1):
        x.release()
    for t in threads:
        t.join(20)
    assert results == [200, 200]


# --- health checking, retries -------------------------------------------------------------------


def test_backend_killed_and_restarted(doubles, proxy_factory):
    p0, p1 = doubles("prefill", "p0"), doubles("prefill", "p1")
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    px = proxy_factory([p0, p1], [d0, d1], ["--policy", "round_robin"])
    key = 'disagg_proxy_backend_healthy{role="%s",backend="%s"}'
    p1.stop()
    d1.stop()
    px.wait_metric(key % ("prefill", p1.url), 0)
    px.wait_metric(key % ("decode", d1.url), 0)
    for x in (p0, d0):
        x.clear()
    for i in range(4):
        assert requests.post(px.url + "/v1/completions", json={"prompt": str(i)}).status_code == 200
    assert len(p0.completions()) == 4 and len(d0.completions()) == 4
    p1.start()
    d1.start()
    px.wait_metric(key % ("prefill", p1.url), 1)
    px.wait_metric(key % ("decode", d1.url), 1)
    for i in range(4):
        assert requests.post(px.url + "/v1/completions", json={"prompt": str(i)}).status_code == 200
    assert len(p1.completions()) == 2 and len(d1.completions()) == 2
    # the restarted prefill was re-discovered: decode bodies carry its new engine id
    engines = {json_body(r)["kv_transfer_params"]["remote_engine_id"] for d in (d0, d1)
               for r in d.completions()}
    assert p1.engine_id(0) in engines and p1.engine_id(0).endswith("g1-dp0")
    assert "engine-p1-g0-dp0" not in engines


def knows(*prefills):
    """A decode double's known_engines: the engine ids the prefills' bootstrap servers
    know now."""
    return lambda: {p.engine_id(r) for p in prefills for r in range(p.dp_ranks)}


def stale_retries(px):
    return px.metrics()["disagg_proxy_stale_engine_retries_total"]


def refreshes(px, p, trigger):
    return px.metrics()[f'disagg_proxy_engine_table_refreshes_total{{backend="{p.url}",'
                        f'trigger="{trigger}"}}']


def test_restart_between_two_probes_is_seen_by_the_next_probe(doubles, proxy_factory):
    """New engine ids with no failed probe (a restart quicker than the probe period):
    the next probe's /query read takes them, and requests name the new engine."""
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    d.known_engines = knows(p)
    px = proxy_factory([p], [d])
    assert requests.post(px.url + "/v1/completions", json={"prompt": "a"}).status_code == 200
    p.engine_generation += 1  # its /health never failed
    deadline = time.monotonic() + 10
    while refreshes(px, p, "probe") != 1:
        assert time.monotonic() < deadline, px.output()[-3000:]
        time.sleep(0.05)
    d.clear()
    assert requests.post(px.url + "/v1/completions", json={"prompt": "b"}).status_code == 200
    assert [json_body(r)["kv_transfer_params"]["remote_engine_id"] for r in d.completions()] == \
        [p.engine_id(0)]
    assert stale_retries(px) == 0 and refreshes(px, p, "unknown_engine") == 0
    assert "restarted" in px.output()


@pytest.mark.parametrize("first", ["prefill", "decode"])
def test_unknown_engine_resends_the_decode_request_once(doubles, proxy_factory, first):
    """D answers that P's bootstrap server knows no such engine: P's table is read
    again and D gets the request again, once, with the new id and the same transfer
    id; P is not asked twice.  A D that rejects the second id too is relayed.  Either
    answers first (D's 400 is read whole before anything is relayed)."""
    p, d = doubles("prefill", "p0", dp_ranks=2), doubles("decode", "d0")
    px = proxy_factory([p], [d], ["--health-interval", "300", "--policy", "round_robin"])
    (d if first == "prefill" else p).delay = 0.2
    d.known_engines = knows(p)
    p.engine_generation += 1  # restarted; the proxy's next probe is minutes away
    for stream in (False, True):
        p.clear()
        d.clear()
        r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 200, r.text
        sent = [json_body(q)["kv_transfer_params"] for q in d.completions()]
        rank = int(p.completions()[0]["headers"]["x-data-parallel-rank"])
        if not stream:  # the first request found the stale id
            assert len(sent) == 2
            assert sent[0]["remote_engine_id"] == f"engine-p0-g0-dp{rank}"
            assert sent[1]["remote_engine_id"] == p.engine_id(rank)
            assert sent[0]["transfer_id"] == sent[1]["transfer_id"]
        else:  # the table was re-read: both ranks are current
            assert [k["remote_engine_id"] for k in sent] == [p.engine_id(rank)]
        assert len(p.completions()) == 1
    assert stale_retries(px) == 1 and refreshes(px, p, "unknown_engine") == 1
    # at most once: P restarts again, every read of its table is followed by new ids
    # (so a second re-read would find yet another id), and D knows none of them
    p.engine_generation += 1
    p.renew_engine_on_query = True
    d.known_engines = lambda: set()
    d.clear()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "y"})
    assert_openai_error(r, 400, "knows no engine")
    assert len(d.completions()) == 2
    assert stale_retries(px) == 2
    assert px.metrics()['disagg_proxy_errors_total{reason="decode_rejected"}'] == 1


def test_unknown_engine_for_concurrent_requests(doubles, proxy_factory):
    """Requests in flight together around P's restart: those sent with the old id are
    resent once each (the re-reads they ask share a /query when they overlap), the
    others go out with the new id; all are answered, the restart is counted once."""
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    px = proxy_factory([p], [d], ["--health-interval", "300"])
    d.known_engines = knows(p)
    p.engine_generation += 1
    p.delay = 0.3  # P's answers come after D's 400s
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(lambda i: requests.post(px.url + "/v1/completions",
                                                     json={"prompt": str(i)}).status_code,
                            range(8)))
    assert codes == [200] * 8
    retried = stale_retries(px)
    assert retried >= 1
    assert len(p.completions()) == 8 and len(d.completions()) == 8 + retried
    new = {json_body(r)["kv_transfer_params"]["remote_engine_id"] for r in d.completions()}
    assert new == {"engine-p0-g0-dp0", p.engine_id(0)}
    assert refreshes(px, p, "unknown_engine") == 1


def test_unknown_engine_while_a_health_probe_hangs(doubles, proxy_factory):
    """The re-read D's answer asks for waits for the probe in flight; when that is
    a /health that never answers, the re-read goes first once it times out (not
    after the repeated /health probes): the request is answered."""
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    px = proxy_factory([p], [d], ["--health-interval", "0.5"])  # probes wait 2 s
    d.known_engines = knows(p)
    p.health_hang = True
    deadline = time.monotonic() + 10
    while not any(r["path"] == "/health" and not r["done"].is_set() for r in list(p.requests)):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    p.engine_generation += 1  # restarted while the probe hangs: it is not re-read yet
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 200, r.text
    assert stale_retries(px) == 1
    p.health_hang = False


@pytest.mark.parametrize("table", ["same", "unreadable"])
def test_unknown_engine_with_no_new_table_relays_the_decodes_400(doubles, proxy_factory, table):
    """A D naming the engine unknown while P's table holds the same id (a hand-made
    configuration error), or a table that cannot be read: D's 400 reaches the client
    as D sent it, D asked once."""
    p, d = doubles("prefill", "p0"), doubles("decode", "d0")
    px = proxy_factory([p], [d], ["--health-interval", "300"])
    d.known_engines = lambda: set()
    if table == "unreadable":
        p.query_status = 503
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"})
    assert_openai_error(r, 400, f"knows no engine '{p.engine_id(0)}'")
    assert len(d.completions()) == 1 and len(p.completions()) == 1
    assert stale_retries(px) == 0
    assert refreshes(px, p, "unknown_engine") == 0
    assert ("could not be read again" if table == "unreadable" else "still names the same engine") \
        in px.output()


def test_retry_on_another_prefill_when_connection_refused(doubles, proxy_factory):
    p0, p1 = doubles("prefill", "p0"), doubles("prefill", "p1")
    d0 = doubles("decode", "d0")
    px = proxy_factory([p0, p1], [d0], ["--policy", "round_robin", "--health-interval", "60"])
    p1_engine = p1.engine_id(0)
    p1.stop()  # the proxy's probes are too slow to notice: the request finds out
    for i in range(4):
        r = requests.post(px.url + "/v1/completions", json={"prompt": str(i)})
        assert r.status_code == 200, r.text
    assert len(p0.completions()) == 4
    m = px.metrics()
    assert m['disagg_proxy_retries_total{role="prefill"}'] >= 1
    assert m['disagg_proxy_backend_healthy{role="prefill",backend="%s"}' % p1.url] == 0
    # each prefill request that was served has one decode twin naming p0's engine; the
    # attempts that named p1 used other transfer ids (and were cancelled)
    d_by_tid = {}
    for rec in d0.completions():
        kv = json_body(rec)["kv_transfer_params"]
        d_by_tid.setdefault(kv["transfer_id"], []).append(kv)
    for rec in p0.completions():
        twins = d_by_tid[json_body(rec)["kv_transfer_params"]["transfer_id"]]
        assert [kv["remote_engine_id"] for kv in twins] == [p0.engine_id(0)]
    named_p1 = [kvs for kvs in d_by_tid.values() if kvs[0]["remote_engine_id"] == p1_engine]
    assert len(named_p1) == m['disagg_proxy_retries_total{role="prefill"}']


def test_retry_on_another_decode_when_connection_refused(doubles, proxy_factory):
    p0 = doubles("prefill", "p0")
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    px = proxy_factory([p0], [d0, d1], ["--policy", "round_robin", "--health-interval", "60"])
    d1.stop()
    for i in range(4):
        r = requests.post(px.url + "/v1/completions", json={"prompt": str(i), "stream": True})
        assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    assert len(d0.completions()) == 4
    assert px.metrics()['disagg_proxy_retries_total{role="decode"}'] >= 1


def test_all_prefills_refuse_gives_503(doubles, proxy_factory):
    p0 = doubles("prefill", "p0")
    d0 = doubles("decode", "d0")
    px = proxy_factory([p0], [d0], ["--health-interval", "60"])
    p0.stop()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"})
    assert_openai_error(r, 503, "prefill", p0.url, "refused the connection")  # names it


# --- bad input ------------------------------------------------------------------------------------


def test_bad_input_matrix(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, extra=["--max-body-bytes", "1000", "--max-headers", "20"])
    u = px.url
    assert_openai_error(requests.post(u + "/v1/completions", data=b"{not json",
                                      headers={"Content-Type": "application/json"}), 400, "not valid JSON")
    assert_openai_error(requests.post(u + "/v1/completions", data=b"[1,2]"), 400, "JSON object", "array")
    assert_openai_error(requests.post(u + "/v1/chat/completions", data=b""), 400, "not valid JSON")
    r = requests.get(u + "/v1/completions")
    assert_openai_error(r, 405, "GET", "POST")
    assert r.headers["Allow"] == "POST"
    r = requests.post(u + "/v1/models", json={})
    assert_openai_error(r, 405, "use GET")
    assert r.headers["Allow"] == "GET"
    r = requests.delete(u + "/health")
    assert_openai_error(r, 405, "DELETE")
    assert r.headers["Allow"] == "GET, HEAD"
    r = requests.head(u + "/health")
    assert r.status_code == 200 and r.content == b"" and r.headers["Content-Length"] == "15"
    assert_openai_error(requests.get(u + "/v2/nothing"), 404, "/v2/nothing")
    assert_openai_error(requests.post(u + "/v1/completions", json={"prompt": "x" * 2000}), 413,
                        "limit of 1000 bytes")
    many = {f"X-H{i}": "v" for i in range(30)}
    assert_openai_error(requests.get(u + "/health", headers=many), 431, "headers")
    status, headers, body = split_response(raw_request(px.port, b"NONSENSE\r\n\r\n"))
    assert status == 400 and json.loads(body)["error"]["code"] == 400
    status, _, body = split_response(raw_request(
        px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"))
    assert status == 413
    # chunked request bodies are accepted too
    status, _, body = split_response(raw_request(
        px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
                 b"Connection: close\r\n\r\n6\r\n{\"prom\r\nB;ext=1\r\npt\": \"a b\"}\r\n0\r\n\r\n"))
    assert status == 200, body
    assert json_body(p.completions()[-1])["prompt"] == "a b"
    assert not [r for r in d.completions() if json_body(r).get("prompt") != "a b"]
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="bad_request"}'] == 3
    assert m['disagg_proxy_errors_total{reason="not_found"}'] == 1
    assert m['disagg_proxy_errors_total{reason="method_not_allowed"}'] == 3


def test_slow_client_request_times_out_with_408(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, extra=["--client-timeout", "0.5"])
    s = socket.create_connection(("127.0.0.1", px.port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n{")
    t0 = time.monotonic()
    raw = b""
    while True:
        c = s.recv(4096)
        if not c:
            break
        raw += c
    s.close()
    assert 0.4 < time.monotonic() - t0 < 3
    status, _, body = split_response(raw)
    assert status == 408 and json.loads(body)["error"]["code"] == 408
    assert not p.completions()


def _sse_events(raw):
    return [e for e in raw.split(b"\n\n") if e]


def test_decode_stalling_mid_stream_ends_with_an_error_event(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, extra=["--timeout", "0.5"])
    d.stream_events = 3
    d.stream_interval = 0.2
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True}, stream=True)
    assert r.status_code == 200
    assert r.raw.read().endswith(b"data: [DONE]\n\n")  # 0.2 s gaps are under the timeout
    d.stream_interval = 1.0  # 1 s of silence before each event: over the 0.5 s upstream timeout
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True}, stream=True)
    assert r.status_code == 200
    raw = b"".join(r.iter_content(None))  # a proper end of the chunked body: no exception
    *_, err_ev, done = _sse_events(raw)
    assert done == b"data: [DONE]"
    err = json.loads(err_ev[len(b"data: "):])["error"]
    assert err["code"] == 504 and "decode" in err["message"] and d.url in err["message"], err
    m = px.metrics()
    assert m['disagg_proxy_errors_total{reason="decode_failed"}'] == 1


def test_split_events_and_a_trailing_partial_event_relayed_unchanged(doubles, proxy_factory):
    """The proxy holds a partial SSE event until its end: events D writes in
    two pieces reach the client whole and unchanged, and bytes after the last event end are
    still relayed when D's answer ends."""
    p, d, px = pd(doubles, proxy_factory)
    d.split_events = True
    d.stream_trailer = b": a comment without an event end"
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 4},
                      stream=True, timeout=10)
    reads = []
    for chunk in r.raw.stream(65536, decode_content=False):
        reads.append(chunk)
    raw = b"".join(reads)
    assert raw == sent(d.completions()[0])
    assert raw.endswith(b"data: [DONE]\n\n: a comment without an event end")
    # every read but the last ended at an event end (no half event reached the client)
    for chunk in reads[:-1]:
        assert chunk.endswith(b"\n\n"), reads


@pytest.mark.parametrize("chat", [False, True])
def test_decode_dying_mid_stream_gives_the_client_a_clean_error(doubles, proxy_factory, chat):
    """D's connection ends mid-event: the client gets the whole events before
    it, then an error event and [DONE], and a properly ended chunked body; the official openai
    client raises APIError naming the decode (not a protocol error)."""
    p, d, px = pd(doubles, proxy_factory)
    d.stream_events = 6
    d.die_after_events = 3
    d.stream_interval = 0.1  # P's 1-token answer comes first: the stream has started
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "m", "stream": True, "max_tokens": 6}
    body.update({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})
    r = requests.post(px.url + path, json=body, stream=True, timeout=10)
    raw = b"".join(r.iter_content(None))
    events = _sse_events(raw)
    whole = sent(d.completions()[0])
    assert raw.startswith(whole[:whole.rindex(b"\n\n") + 2])  # every whole event, unchanged
    assert len(events) == 3 + 2 and events[-1] == b"data: [DONE]", raw
    err = json.loads(events[-2][len(b"data: "):])["error"]
    assert err["code"] == 502 and err["type"] == "BadGatewayError" and d.url in err["message"], err
    # the connection is still usable (the reply ended properly), and the openai client
    c = openai.OpenAI(base_url=px.url + "/v1", api_key="x", max_retries=0, timeout=10)
    got = []
    with pytest.raises(openai.APIError) as ei:
        if chat:
            for ch in c.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=6, stream=True):
                got.append(ch.choices[0].delta.content)
        else:
            for ch in c.completions.create(model="m", prompt="x", max_tokens=6, stream=True):
                got.append(ch.choices[0].text)
    assert not isinstance(ei.value, openai.APIConnectionError), ei.value
    assert "decode instance" in str(ei.value) and d.url in str(ei.value)
    assert len(got) == 3
    assert px.metrics()['disagg_proxy_errors_total{reason="decode_failed"}'] == 2


# --- metrics --------------------------------------------------------------------------------------


def test_metrics_content(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    for stream in (False, True, False):
        r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": stream})
        assert r.status_code == 200
    requests.get(px.url + "/v1/nope")
    m = px.metrics()
    assert m['disagg_proxy_requests_total{endpoint="/v1/completions"}'] == 3
    assert m['disagg_proxy_responses_total{code="2xx"}'] >= 3
    assert m['disagg_proxy_responses_total{code="4xx"}'] == 1
    assert m['disagg_proxy_errors_total{reason="not_found"}'] == 1
    for role, x in (("prefill", p), ("decode", d)):
        lab = f'role="{role}",backend="{x.url}"'
        assert m[f"disagg_proxy_backend_requests_total{{{lab}}}"] == 3
        assert m[f"disagg_proxy_backend_outstanding_requests{{{lab}}}"] == 0
        assert m[f"disagg_proxy_backend_healthy{{{lab}}}"] == 1
        assert m[f"disagg_proxy_backend_errors_total{{{lab}}}"] == 0
        assert m[f"disagg_proxy_backend_latency_seconds_count{{{lab}}}"] == 3
        assert m[f'disagg_proxy_backend_latency_seconds_bucket{{{lab},le="+Inf"}}'] == 3
        assert m[f"disagg_proxy_backend_latency_seconds_sum{{{lab}}}"] > 0
    for phase in ("prefill", "decode", "first_byte", "total"):
        assert m[f'disagg_proxy_phase_seconds_count{{phase="{phase}"}}'] == 3
    # histogram buckets are cumulative
    buckets = [v for k, v in m.items() if k.startswith('disagg_proxy_phase_seconds_bucket{phase="total"')]
    assert buckets == sorted(buckets) and buckets[-1] == 3


# --- command line --------------------------------------------------------------------------------------


@pytest.mark.parametrize("args,needle", [
    ([], "at least one --prefill and one --decode"),
    (["--prefill", "http://127.0.0.1:1"], "at least one --prefill and one --decode"),
    (["--prefill", "https://a:1", "--decode", "http://b:2"], "https is not supported"),
    (["--prefill", "http://a:99999", "--decode", "http://b:2"], "port '99999'"),
    (["--prefill", "http://a:1", "70000", "--decode", "http://b:2"], "bootstrap port '70000'"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--policy", "random"], "'random'"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--port", "x"], "--port 'x'"),
    (["--prefill", "http://a:1", "--decode", "http://b:2", "--frob"], "'--frob'"),
])
def test_cli_usage_errors(args, needle):
    import subprocess
    r = subprocess.run([BIN, "proxy", *args], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr, r.stderr


def test_cli_help_and_listed():
    import subprocess
    r = subprocess.run([BIN, "proxy", "--help"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 0 and "--prefill URL [BOOTSTRAP]" in r.stdout and "--policy" in r.stdout
    r = subprocess.run([BIN, "--help"], capture_output=True, text=True, timeout=10)
    assert "proxy" in r.stdout


def test_listen_port_in_use_fails_clearly(doubles):
    import subprocess
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    r = subprocess.run([BIN, "proxy", "--port", str(port), "--prefill", "http://127.0.0.1:1",
                        "--decode", "http://127.0.0.1:2"], capture_output=True, text=True, timeout=10)
    s.close()
    assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr


# --- bounded buffers, timeouts, HTTP/1.0 ---------------------------------------------------------------


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_large_stream_slow_client_and_slow_prefill_backpressure(doubles, proxy_factory):
    """An 8 MB stream: held while the prefill is slow (over the 1 MiB hold cap), then
    relayed to a client that does not read for a while.  The proxy waits without
    buffering the stream in memory, and every byte arrives in order."""
    p, d, px = pd(doubles, proxy_factory)
    d.stream_events = 64
    d.event_pad = 128 * 1024
    p.delay = 0.5
    rss0 = rss_bytes(px.proc.pid)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 32 * 1024)
    s.connect(("127.0.0.1", px.port))
    body = json.dumps({"prompt": "big", "stream": True, "max_tokens": 64}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    time.sleep(1.5)  # client not reading
    assert px.metrics()["disagg_proxy_inflight_requests"] == 1  # more than the kernel buffers hold
    grown = rss_bytes(px.proc.pid) - rss0
    if os.environ.get("DISAGG_SANITIZED", "0") not in ("1", "ON", "TRUE", "true"):
        # (ASan's quarantine keeps freed memory resident: RSS means nothing there)
        assert grown < 3 * 1024 * 1024, f"proxy RSS grew by {grown} bytes"
    chunks = []
    s.settimeout(10)
    while True:
        c = s.recv(1 << 16)
        if not c:
            break
        chunks.append(c)
    status, headers, raw = split_response(b"".join(chunks))
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    out, i = [], 0  # de-chunk
    while True:
        j = raw.index(b"\r\n", i)
        n = int(raw[i:j], 16)
        if n == 0:
            break
        out.append(raw[j + 2:j + 2 + n])
        i = j + 2 + n + 2
    got = b"".join(out)
    assert len(got) > 8_000_000
    assert got == sent(d.completions()[0])


def test_upstream_timeout_gives_504(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, extra=["--timeout", "0.5"])
    d.hold = True
    t0 = time.monotonic()
    r = requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
    assert time.monotonic() - t0 < 3
    assert_openai_error(r, 504, "decode", d.url, "timed out")
    rec = d.completions()[0]
    assert rec["done"].wait(5) and rec["peer_closed"]


def test_http10_client_gets_close_delimited_stream(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    body = json.dumps({"prompt": "x", "stream": True}).encode()
    raw = raw_request(px.port, b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s"
                      % (len(body), body))
    status, headers, got = split_response(raw)
    assert status == 200 and "transfer-encoding" not in headers and "content-length" not in headers
    assert got == sent(d.completions()[0])


def test_expect_100_continue(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory)
    body = json.dumps({"prompt": "x"}).encode()
    s = socket.create_connection(("127.0.0.1", px.port), timeout=5)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nConnection: close\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body))
    assert s.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
    s.sendall(body)
    chunks = []
    while True:
        c = s.recv(65536)
        if not c:
            break
        chunks.append(c)
    status, _, got = split_response(b"".join(chunks))
    assert status == 200 and got == sent(d.completions()[0])


def test_out_of_descriptors_pauses_accepting_then_recovers(doubles, proxy_factory):
    p, d, px = pd(doubles, proxy_factory, nofile=48)
    socks = []
    for _ in range(80):  # more connections than the proxy has descriptors
        s = socket.socket()
        s.settimeout(2)
        s.connect(("127.0.0.1", px.port))
        socks.append(s)
    with open(f"/proc/{px.proc.pid}/stat") as f:
        t0 = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13])
    time.sleep(1.0)
    with open(f"/proc/{px.proc.pid}/stat") as f:
        px_cpu = sum(int(x) for x in f.read().rsplit(")", 1)[1].split()[11:13]) - t0
    assert px_cpu < 30, f"proxy used {px_cpu} ticks in 1 s while out of descriptors (spinning)"
    assert "accept failed" in px.output()
    for s in socks:
        s.close()
    deadline = time.monotonic() + 5
    while True:
        try:
            r = requests.post(px.url + "/v1/completions", json={"prompt": "x"}, timeout=2)
            break
        except requests.RequestException:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert r.status_code == 200


# --- shutdown ---------------------------------------------------------------------------------------------


def test_sigterm_drains_requests_in_flight(doubles, proxy_factory):
    import signal
    p, d, px = pd(doubles, proxy_factory, extra=["--shutdown-timeout", "10"])
    d.hold = True
    keep = http.client.HTTPConnection("127.0.0.1", px.port, timeout=10)  # an open keep-alive connection
    keep.request("GET", "/health")
    assert keep.getresponse().read() == b'{"status":"ok"}'
    result = {}

    def client():
        r = requests.post(px.url + "/v1/completions", json={"prompt": "x", "stream": True}, timeout=20)
        result["status"], result["body"] = r.status_code, r.content

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 5
    while not d.completions() and time.monotonic() < deadline:
        time.sleep(0.01)
    px.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert px.proc.poll() is None  # still serving the request in flight
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", px.port), timeout=1)  # no new connections
    keep.request("GET", "/health")
    r = keep.getresponse()
    assert r.status == 503 and b"shutting down" in r.read()
    d.release()
    t.join(10)
    assert result["status"] == 200 and result["body"].endswith(b"data: [DONE]\n\n")
    assert px.proc.wait(5) == 0


def test_shutdown_timeout_and_second_signal(doubles, proxy_factory):
    import signal
    p, d, px = pd(doubles, proxy_factory, extra=["--shutdown-timeout", "0.5"])
    d.hold = True
    got = []

    def post(url):
        try:
            got.append(requests.post(url + "/v1/completions", json={"prompt": "x"}, timeout=20))
        except requests.ConnectionError as e:
            got.append(e)

    t = threading.Thread(target=post, args=(px.url,))
    t.start()
    deadline = time.monotonic() + 5
    while not d.completions() and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    px.proc.send_signal(signal.SIGTERM)
    assert px.proc.wait(5) == 0
    assert 0.4 < time.monotonic() - t0 < 3
    assert "shutdown timeout" in px.output()
    rec = d.completions()[0]
    assert rec["done"].wait(5) and rec["peer_closed"]  # the decode request was cancelled on exit
    t.join(5)
    assert isinstance(got[0], requests.ConnectionError)  # the client saw the connection close

    px2 = proxy_factory([p], [d], ["--shutdown-timeout", "60"])
    d.clear()
    t = threading.Thread(target=post, args=(px2.url,))
    t.start()
    while not d.completions() and time.monotonic() < deadline + 5:
        time.sleep(0.01)
    px2.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert px2.proc.poll() is None
    t0 = time.monotonic()
    px2.proc.send_signal(signal.SIGINT)
    assert px2.proc.wait(5) == 0 and time.monotonic() - t0 < 2
    t.join(5)
    assert isinstance(got[1], requests.ConnectionError)


# --- vLLM toy-proxy compatibility ---------------------------------------------------------------------------


def test_toy_proxy_flags_and_healthcheck(doubles, proxy_factory):
    """`--prefiller-hosts/--prefiller-ports/--decoder-hosts/--decoder-ports` as in vLLM's
    toy_proxy_server.py (bootstrap on port 8998 of the prefill host, which this test
    does not serve: the flags' parsing and the liveness endpoint are checked)."""
    import subprocess
    p = doubles("prefill", "p0")
    d0, d1 = doubles("decode", "d0"), doubles("decode", "d1")
    port = free_port()
    proc = subprocess.Popen([BIN, "proxy", "--port", str(port), "--prefiller-hosts", "127.0.0.1",
                             "--prefiller-ports", str(p.port), "--decoder-hosts", "127.0.0.1", "127.0.0.1",
                             "--decoder-ports", str(d0.port), str(d1.port), "--health-interval", "0.1"],
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 5
        while True:
            try:
                r = requests.get(f"http://127.0.0.1:{port}/healthcheck", timeout=1)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        assert r.status_code == 200
        j = r.json()
        assert j["status"] == "ok" and j["prefill_instances"] == 1 and j["decode_instances"] == 2
        assert isinstance(j["ready"], bool)
        time.sleep(0.3)
        m = requests.get(f"http://127.0.0.1:{port}/metrics").text
        assert f'disagg_proxy_backend_healthy{{role="decode",backend="{d1.url}"}} 1' in m
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    # the default bootstrap port on the prefill host
    assert f"prefill {p.url} (bootstrap http://127.0.0.1:8998)" in proc.stderr.read()


def test_toy_proxy_flag_count_mismatch():
    import subprocess
    r = subprocess.run([BIN, "proxy", "--prefiller-hosts", "a", "b", "c", "--prefiller-ports", "1", "2",
                        "--decoder-host", "d"], capture_output=True, text=True, timeout=10)
    assert r.returncode == 2 and "3 --prefiller-hosts but 2 --prefiller-ports" in r.stderr
