"""Hostile input at the front door: malformed JSON and text, unimplemented fields, the API key
on every endpoint, Host and Content-Type rules, body size, and /health while a large body is
refused. The session server has an API key; a second server has none, its own allowed host,
a small body limit and a served model name."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import psutil
import pytest

from airserve.srt.managers.validation import NATIVE_NOT_IMPLEMENTED, OPENAI_NOT_IMPLEMENTED
from airserve.srt.sampling.sampling_params import NOT_IMPLEMENTED
from airserve_testing.server_utils import ServerProcess

GEN, C, CHAT = "/generate", "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
BASE = {GEN: {"text": "Hello", "sampling_params": {"max_new_tokens": 2}},
        C: {"prompt": "Hello", "max_tokens": 2},
        CHAT: {"messages": MSG, "max_tokens": 2}}
JSON = {"Content-Type": "application/json"}


def post_raw(http, path: str, text: str, headers: dict | None = None) -> httpx.Response:
    return http.post(path, content=text.encode(), headers={**JSON, **(headers or {})})


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message


# JSON and text the parser must refuse with a 400, never a 500.
@pytest.mark.parametrize("path", [GEN, C, CHAT])
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_nan_and_infinity_literals_are_refused(http, path, literal):
    body = json.dumps(BASE[path])[:-1] + f', "temperature": {literal}}}'
    assert_error(post_raw(http, path, body), 400, literal, "finite")


@pytest.mark.parametrize("path,body,field", [
    (GEN, '{"text": "x", "sampling_params": {"temperature": 1e999}}', "temperature"),
    (C, '{"prompt": "x", "temperature": 1e999}', "temperature"),
    (CHAT, '{"messages": [{"role": "user", "content": "x"}], "top_p": -1e999}', "top_p"),
])
def test_overflowing_floats_name_the_field(http, path, body, field):
    assert_error(post_raw(http, path, body), 400, field)


@pytest.mark.parametrize("path,body", [
    (GEN, {"text": "x", "sampling_params": {"seed": 2**64}}),
    (C, {"prompt": "x", "seed": 2**64}),
    (CHAT, {"messages": MSG, "seed": -1}),
])
def test_out_of_range_seed_names_the_field_and_range(http, path, body):
    assert_error(http.post(path, json=body), 400, "seed", "9223372036854775807")


@pytest.mark.parametrize("path,body,field", [
    (GEN, {"text": "x", "sampling_params": {"max_new_tokens": True}}, "max_new_tokens"),
    (GEN, {"text": "x", "sampling_params": {"top_k": 2.0}}, "top_k"),
    (GEN, {"text": "x", "sampling_params": {"temperature": "0"}}, "temperature"),
    (GEN, {"text": "x", "sampling_params": {"stop_token_ids": [1, True]}}, "stop_token_ids"),
    (GEN, {"text": "x", "sampling_params": {"stop_token_ids": [10**6]}}, "stop_token_ids"),
    (GEN, {"text": "x", "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}},
     "min_new_tokens"),
    (GEN, {"text": "x", "stream": 1}, "stream"),
    (GEN, {"text": ["a", 1]}, "text.1"),
    (GEN, {"input_ids": [[1, 2], [1, True]]}, "input_ids.1"),
    (GEN, {"text": ["a", "b"], "rid": ["same", "same"]}, "rid"),
    (C, {"prompt": "x", "max_tokens": True}, "max_tokens"),
    (C, {"prompt": "x", "temperature": False}, "temperature"),
    (CHAT, {"messages": MSG, "n": 1.0}, "n"),
])
def test_wrong_types_and_ranges_name_the_field(http, path, body, field):
    assert_error(http.post(path, json=body), 400, field)


@pytest.mark.parametrize("path", [GEN, C, CHAT])
def test_lone_surrogates_are_refused(http, path):
    body = json.dumps({**BASE[path], "rid" if path == GEN else "user": "\ud800"})
    assert "\\ud800" in body  # valid JSON: an escaped lone surrogate
    assert_error(post_raw(http, path, body), 400, "surrogate")
    body = json.dumps(BASE[path]).replace("H", "\\udfffH", 1).replace("hi", "\\ud83dhi")
    assert_error(post_raw(http, path, body), 400, "surrogate")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_refused(http, depth):
    body = '{"text": "x", "extra": ' + "[" * depth + "]" * depth + "}"
    assert_error(post_raw(http, GEN, body), 400, "nested")


def test_huge_integer_literal_is_refused(http):
    assert_error(post_raw(http, GEN, '{"text": "x", "rid": ' + "9" * 5000 + "}"), 400, "JSON")


# Fields that would change the output and are not implemented: refused when set.
# `n` is in the table for the offline Engine; /generate implements it (test_http_logprobs).
@pytest.mark.parametrize("name", sorted(set(NOT_IMPLEMENTED) - {"n"}))
def test_unimplemented_sampling_fields_are_refused(http, name):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 1, name: {"set": True}}}
    assert_error(http.post(GEN, json=body), 400, f"sampling_params.{name}", "not supported")


@pytest.mark.parametrize("name", sorted(NATIVE_NOT_IMPLEMENTED))
def test_unimplemented_generate_fields_are_refused(http, name):
    assert_error(http.post(GEN, json={"text": "x", name: ["set"]}), 400, name, "not supported")


@pytest.mark.parametrize("path", [C, CHAT])
@pytest.mark.parametrize("name", sorted(OPENAI_NOT_IMPLEMENTED))
def test_unimplemented_openai_fields_are_refused(http, path, name):
    assert_error(http.post(path, json={**BASE[path], name: {"set": 1}}), 400, name,
                 "not supported")


def test_no_op_values_and_bookkeeping_fields_are_accepted(http):
    r = http.post(GEN, json={"text": "x", "return_logprob": False, "lora_path": None,
                             "log_metrics": True, "priority": 3,
                             "sampling_params": {"max_new_tokens": 1, "n": 1, "regex": None,
                                                 "logit_bias": {}, "stream_interval": 4}})
    assert r.status_code == 200, r.text
    r = http.post(CHAT, json={**BASE[CHAT], "logprobs": False, "tool_choice": "none",
                              "response_format": {"type": "text"}, "user": "me", "best_of": 1})
    assert r.status_code == 200, r.text


# API key: every endpoint but /health needs it; the scheme is case-insensitive.
ENDPOINTS = [("GET", "/v1/models", None), ("GET", "/get_model_info", None),
             ("GET", "/get_server_info", None), ("POST", "/flush_cache", None),
             ("GET", "/metrics", None), ("GET", "/health_generate", None),
             ("POST", GEN, BASE[GEN]), ("POST", C, BASE[C]), ("POST", CHAT, BASE[CHAT])]


@pytest.mark.parametrize("method,path,body", ENDPOINTS, ids=[e[1] for e in ENDPOINTS])
@pytest.mark.parametrize("auth,allowed", [
    (None, False), ("Bearer wrong", False), ("Bearer test-key-and-more", False),
    ("Basic test-key", False), ("test-key", False), ("Bearer test-key", True),
    ("bearer test-key", True), ("BEARER  test-key", True),
])
def test_api_key_matrix(server, method, path, body, auth, allowed):
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, server.url + path, json=body, headers=headers, timeout=60)
    if allowed:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 401, "API key")


def test_health_needs_no_api_key(server):
    assert httpx.get(server.url + "/health").status_code == 200


# Host and Content-Type.
@pytest.mark.parametrize("host,ok", [
    ("127.0.0.1:{port}", True), ("localhost:{port}", True), ("LOCALHOST", True),
    ("[::1]:{port}", True), ("evil.example:{port}", False), ("127.0.0.1.nip.io", False),
    ("", False),
])
@pytest.mark.parametrize("path", ["/health", GEN])
def test_host_header_must_name_this_server(server, http, host, ok, path):
    headers = {"Host": host.format(port=server.port)}
    r = http.post(path, json=BASE[GEN], headers=headers) if path == GEN else \
        http.get(path, headers=headers)
    if ok:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 400, "--allowed-hosts")


@pytest.mark.parametrize("content_type,status", [
    ("application/json", 200), ("application/json; charset=utf-8", 200),
    ("Application/JSON", 200), ("text/plain", 415), ("text/plain;charset=UTF-8", 415),
    ("application/x-www-form-urlencoded", 415), ("multipart/form-data", 415), (None, 415),
])
@pytest.mark.parametrize("path", [GEN, C, CHAT])
def test_json_endpoints_need_a_json_content_type(http, path, content_type, status):
    headers = {"Content-Type": content_type} if content_type else {}
    r = http.post(path, content=json.dumps(BASE[path]).encode(), headers=headers)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        assert_error(r, 415, "application/json")


# Body size, and /health while a large body is refused.
def raw_request(port: int, head: str, body_chunks=(), host: str = "127.0.0.1") -> bytes:
    """Send a request by hand; returns the response (b"" if the server closed first)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n")
        try:
            for chunk in body_chunks:
                s.sendall(chunk)
        except OSError:
            pass  # the server answered and closed while we were still sending
        data = b""
        try:
            while chunk := s.recv(65536):
                data += chunk
        except OSError:
            pass
        return data


def test_content_length_above_the_limit_is_refused_before_reading(server):
    head = (f"POST /generate HTTP/1.1\nHost: 127.0.0.1\nAuthorization: Bearer test-key\n"
            f"Content-Type: application/json\nContent-Length: {64 << 20}\n")
    t = time.perf_counter()
    response = raw_request(server.port, head)  # no body sent at all
    assert time.perf_counter() - t < 5
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"--max-request-body-bytes" in response


def test_health_stays_fast_and_memory_returns_while_25mb_bodies_are_refused(server, http):
    proc = psutil.Process(server.proc.pid)  # the HTTP process (the scheduler is a child)
    rss_before = proc.memory_info().rss
    body = json.dumps({"text": "The quick brown fox. " * (25_000_000 // 21),
                       "sampling_params": {"max_new_tokens": 1}}).encode()
    answers, latencies = [], []

    def send():
        with server.client() as c:
            for _ in range(3):
                answers.append(c.post(GEN, content=body, headers=JSON))

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        t = time.perf_counter()
        assert http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t)
        time.sleep(0.01)
    sender.join()
    assert len(answers) == 3
    for r in answers:
        assert_error(r, 400, "characters", "context length")
    assert len(latencies) > 5 and max(latencies) < 0.5, (max(latencies), len(latencies))
    grown = proc.memory_info().rss - rss_before
    assert grown < 150 << 20, f"RSS grew by {grown >> 20} MiB"
    assert http.post(GEN, json=BASE[GEN]).status_code == 200


# A second server: no API key, an extra allowed host, a small body limit, a served name.
@pytest.fixture(scope="module")
def open_server(tiny_llama_dir):
    srv = ServerProcess(tiny_llama_dir, "--allowed-hosts", "airserve.internal",
                        "--max-request-body-bytes", "100000", "--served-model-name", "tiny-chat",
                        "--skip-server-warmup", api_key=None).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_streamed_body_past_the_limit_is_refused(open_server):
    head = ("POST /generate HTTP/1.1\nHost: 127.0.0.1\nContent-Type: application/json\n"
            "Transfer-Encoding: chunked\n")
    piece = b'{"text": "' + b"a" * 60_000
    chunks = [b"%x\r\n%s\r\n" % (len(piece), piece)] * 4 + [b"0\r\n\r\n"]
    response = raw_request(open_server.port, head, chunks)
    assert response.startswith(b"HTTP/1.1 413"), response[:200]
    assert b"100000 bytes" in response
    assert httpx.get(open_server.url + "/health").status_code == 200


def test_allowed_hosts_and_served_model_name(open_server):
    with httpx.Client(base_url=open_server.url, timeout=60) as c:
        assert c.get("/health", headers={"Host": "airserve.internal:80"}).status_code == 200
        assert_error(c.get("/health", headers={"Host": "other.internal"}), 400, "Host")
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["tiny-chat"]
        r = c.post(CHAT, json={**BASE[CHAT], "model": "tiny-chat"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-chat", r.text
        r = c.post(C, json={**BASE[C], "model": "default"})
        assert r.status_code == 200 and r.json()["model"] == "tiny-chat", r.text
        # Without a key the Content-Type rule still holds (a web page's text/plain post).
        r = c.post(GEN, content=json.dumps(BASE[GEN]).encode(),
                   headers={"Content-Type": "text/plain"})
        assert_error(r, 415, "Content-Type")
