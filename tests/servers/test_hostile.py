"""Hostile clients against the engine server on loopback: a body too large, text that cannot fit or is not Unicode,
bodies that are not JSON, headers trickled or never sent, a stream left unread. Each gets its bounded answer, and
the server goes on serving."""
import json
import socket
import time

import httpx
import pytest

from servers.app import longest_token_chars
from tests.serving import BACKENDS, Server, metric, slow_steps, wait_for

LIMIT = 256 * 1024  # bytes: this server's max_body_bytes
TOKENS = 512  # the harness's max_request_tokens
READ_S, SEND_S, UNREAD = 1.0, 1.0, 8192  # this server's read_timeout_s, send_timeout_s, max_unread_bytes


@pytest.fixture(scope="module")
def hostile(chat_model):
    with Server(*chat_model, BACKENDS["engine"], max_body_bytes=LIMIT, read_timeout_s=READ_S, send_timeout_s=SEND_S,
                max_unread_bytes=UNREAD) as s:
        yield s


def post(s, path: str, content) -> httpx.Response:
    return httpx.post(f"{s.url}{path}", content=content, headers={"content-type": "application/json"}, timeout=30)


def served(s) -> bool:
    r = post(s, "/v1/completions", json.dumps({"prompt": "Hello", "max_tokens": 2}))
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_a_body_over_the_limit_gets_413_naming_it_declared_or_chunked(hostile):
    declared = post(hostile, "/v1/completions", json.dumps({"prompt": "a" * LIMIT}))
    assert declared.status_code == 413 and f"{LIMIT} bytes" in declared.json()["error"]["message"]

    def chunks():  # no Content-Length: the bytes are counted as they come
        yield b'{"prompt": "'
        for _ in range(LIMIT // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    streamed = post(hostile, "/v1/completions", chunks())
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "request_too_large"
    assert served(hostile)  # ordinary requests pass the limit untouched


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda text: {"prompt": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
], ids=["completions", "chat"])
def test_text_that_cannot_fit_is_refused_before_the_tokenizer_sees_it(hostile, chat_model, monkeypatch, path, body):
    tok = chat_model[1]
    most = TOKENS * longest_token_chars(tok)  # characters: no token stands for more than the longest one's
    seen = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(tok, name)
        monkeypatch.setattr(tok, name, lambda *a, _real=real, **k: seen.append(1) or _real(*a, **k))
    r = post(hostile, path, json.dumps(body("ab " * (most // 3 + 1))))
    assert r.status_code == 400 and f"max_request_tokens = {TOKENS}" in r.json()["error"]["message"], r.text
    assert not seen  # refused from its length alone
    fits = post(hostile, path, json.dumps({**body("ab " * 8), "max_tokens": 2}))
    assert fits.status_code == 200 and seen  # below the bound the prompt is tokenized as before


BROKEN = [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "U+D800"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "lone surrogate"),
    ("/v1/completions", '{"prompt": "hi \\udc00 there"}', "character 3"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \xff\xfe"}]}', "UTF-8"),
    ("/v1/chat/completions", '{"messages": ' + "[" * 100_000 + "]" * 100_000 + "}", "JSON"),
]


@pytest.mark.parametrize("path, content, text", BROKEN, ids=["surrogate", "surrogate-part", "surrogate-prompt",
                                                             "bad-utf8", "nested"])
def test_text_that_is_not_unicode_or_not_json_gets_400_in_openai_shape(hostile, path, content, text):
    r = post(hostile, path, content)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["type"] == "invalid_request_error", err
    assert served(hostile)


@pytest.mark.parametrize("path, field", [("/v1/completions", "max_tokens"),
                                         ("/v1/chat/completions", "max_completion_tokens")],
                         ids=["completions", "chat"])
def test_a_billion_tokens_asked_gets_400_naming_the_bound(hostile, path, field):
    body = {"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(hostile, path, json.dumps({**body, field: 10**9}))
    assert r.status_code == 400 and str(TOKENS) in r.json()["error"]["message"], r.text
    assert served(hostile)


def raw(s, rcvbuf: int | None = None) -> socket.socket:
    conn = socket.socket()
    if rcvbuf:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # before connecting, so the window stays small
    conn.connect(("127.0.0.1", s.port))
    return conn


def answer(conn: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when it closed (s from now)."""
    conn.settimeout(timeout_s)
    start, data = time.monotonic(), b""
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data, time.monotonic() - start


@pytest.mark.parametrize("sent", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le",
                                  b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n{"],
                         ids=["idle", "trickled-headers", "trickled-body"])
def test_a_request_that_does_not_arrive_in_time_gets_408_and_is_closed(hostile, sent):
    conn = raw(hostile)
    conn.sendall(sent)
    data, closed = answer(conn, READ_S + 5)
    assert data.startswith(b"HTTP/1.1 408") and READ_S * 0.9 < closed < READ_S + 2, (data, closed)
    assert served(hostile)


def test_a_slow_reader_is_dropped_and_its_request_aborted_while_others_stream(hostile):
    """Steps slowed to 10 ms. A client asks for 400 tokens with their logprobs (about 600 bytes an event) and reads
    nothing: its socket's buffers and the server's fill within about 100 tokens, and after send_timeout_s it is
    dropped and its request aborted. A client beside it that reads streams all its tokens."""
    undo = slow_steps(hostile, 0.01)
    aborted = metric(hostile.url, "vllm:request_success_total", finished_reason="abort")
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 400, "ignore_eos": True, "stream": True,
            "logprobs": True, "top_logprobs": 5}
    slow = raw(hostile, rcvbuf=4096)
    text = json.dumps(body).encode()
    slow.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(text), text))
    start = time.monotonic()
    with httpx.stream("POST", f"{hostile.url}/v1/chat/completions", json={**body, "max_tokens": 100},
                      timeout=30) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    read = sum(len((e["choices"][0]["logprobs"] or {"content": []})["content"]) for e in events if e["choices"])
    assert read == 100  # the reader beside it never waited
    wait_for(lambda: metric(hostile.url, "vllm:request_success_total", finished_reason="abort") == aborted + 1,
             10, "the slow reader's request was not aborted")
    assert time.monotonic() - start < 4.0 + SEND_S  # 400 tokens would take 4 s of steps alone
    undo()
    data, _ = answer(slow, 5)
    assert b"[DONE]" not in data
    assert served(hostile)
