"""Hostile clients against the engine server on loopback: a body too large, text that cannot fit or is not Unicode,
bodies that are not JSON. Each gets its bounded, OpenAI-shaped answer, and the server goes on serving."""
import json

import httpx
import pytest

from servers.app import longest_token_chars
from tests.serving import BACKENDS, Server

LIMIT = 256 * 1024  # bytes: this server's max_body_bytes
TOKENS = 512  # the harness's max_request_tokens


@pytest.fixture(scope="module")
def hostile(chat_model):
    with Server(*chat_model, BACKENDS["engine"], max_body_bytes=LIMIT) as s:
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
