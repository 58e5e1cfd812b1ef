"""The OpenAI-compatible server against the official client and load testers' request bodies: streaming and not,
content parts, logprobs, penalties, stop strings, bad inputs (400, 401, 404), and greedy output equal to Hugging Face
generate, on every backend."""
import json
from pathlib import Path

import httpx
import openai
import pytest
import torch

from engine.model.hf import generate_alone
from engine.specs import PolicySpec
from tests.serving import BACKENDS, Server, client


def test_chat_and_completions_stream_and_not(any_server):
    c = client(any_server)
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
    assert r.choices[0].message.role == "assistant"
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                            max_completion_tokens=8, stream=True, temperature=0,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == r.choices[0].message.content  # greedy: the same answer streamed and not
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    comp = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=5, temperature=0.7, seed=3,
                                extra_body={"ignore_eos": True})
    again = c.completions.create(model="tiny-chat", prompt="Once upon a time", max_tokens=5, temperature=0.7, seed=3,
                                 extra_body={"ignore_eos": True})
    assert comp.choices[0].text == again.choices[0].text and comp.usage.completion_tokens == 5
    assert [m.id for m in c.models.list().data] == ["tiny-chat"]


def test_greedy_output_equals_generate(any_server, chat_model):
    model, tok = chat_model
    c = client(any_server)
    for text in ["Hello there", "The capital of France is", "1, 2, 3,"]:
        ids = tok.encode(text)
        ref = generate_alone(model, ids, 12)
        got = c.completions.create(model="tiny-chat", prompt=ids, max_tokens=12, temperature=0,
                                   extra_body={"ignore_eos": True}).choices[0].text
        assert got == tok.decode(ref, skip_special_tokens=True)


def test_stop_strings(any_server):
    c = client(any_server)
    full = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0,
                                extra_body={"ignore_eos": True}).choices[0].text
    i = next(i for i in range(len(full) // 2, len(full) - 1) if full[i:i + 2].strip())
    stop = full[i:i + 2]
    r = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0, stop=[stop],
                             extra_body={"ignore_eos": True}).choices[0]
    assert r.finish_reason == "stop" and r.text == full[:full.find(stop)]
    chunks = list(c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=12, temperature=0, stop=stop,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == r.text and chunks[-1].choices[0].finish_reason == "stop"


def test_content_parts_logprobs_and_usage_with_the_openai_client(server, chat_model):
    """Content parts are joined into the prompt; logprobs are the model's own (a forward pass here), the chosen
    token first among the top ones under greedy; continuous usage counts up on every chunk."""
    model, tok = chat_model
    c = client(server)
    parts = [{"type": "text", "text": "The capital"}, {"type": "text", "text": " of France"}]
    r = c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": parts}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    plain = c.chat.completions.create(model="tiny-chat", max_tokens=4, temperature=0, extra_body={"ignore_eos": True},
                                      messages=[{"role": "user", "content": "The capital of France"}])
    assert r.choices[0].message.content == plain.choices[0].message.content
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens
    lps = r.choices[0].logprobs.content
    assert len(lps) == 4 and all(len(e.top_logprobs) == 3 for e in lps)
    ids = tok.apply_chat_template([{"role": "user", "content": "The capital of France"}], add_generation_prompt=True,
                                  tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        ref = model(torch.tensor([list(ids)])).logits[0, -1].float().log_softmax(-1)
    top = ref.topk(3)
    assert abs(lps[0].logprob - top.values[0].item()) < 1e-3
    assert [e.token for e in lps[0].top_logprobs] == [tok.decode([t]) for t in top.indices.tolist()]
    assert all(e.logprob == e.top_logprobs[0].logprob for e in lps)  # greedy picks the most likely
    chunks = list(c.chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": parts}],
                                            max_tokens=5, temperature=0, stream=True, logprobs=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True},
                                            extra_body={"ignore_eos": True}))
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and None not in counts
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices and ch.choices[0].logprobs) == 5
    comp = c.completions.create(model="tiny-chat", prompt="Hello", max_tokens=3, temperature=0, logprobs=2,
                                extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 3 and len(lp.token_logprobs) == 3 and all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == comp.choices[0].text and lp.text_offset[0] == 0


def test_penalties_change_greedy_output(server):
    """A repetition penalty of 2 (HF's rule) must change a greedy answer that repeats tokens; 1.0 must not."""
    c = client(server)

    def ask(**kw):
        return c.completions.create(model="tiny-chat", prompt="1, 2, 3, 1, 2, 3,", max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True, **kw}).choices[0].text

    base = ask()
    assert ask(repetition_penalty=1.0) == base
    assert ask(repetition_penalty=2.0) != base
    assert ask(frequency_penalty=2.0, presence_penalty=2.0) != base


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize("name", ["guidellm_chat", "guidellm_completions", "vllm_bench_chat",
                                  "vllm_bench_completions"])
def test_load_testers_request_bodies(server, name):
    """The exact bodies guidellm and `vllm bench serve` send: every field taken, streamed text and usage back."""
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    with httpx.Client(timeout=30) as h, h.stream("POST", server.url + path, json=body) as r:
        assert r.status_code == 200, r.read()
        msgs = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    want = body.get("max_tokens") or body["max_completion_tokens"]
    assert msgs[-1]["usage"]["completion_tokens"] == want and not any("error" in m for m in msgs)
    if body["stream_options"].get("continuous_usage_stats"):
        assert all(m["usage"] for m in msgs)
    else:
        assert all(m["usage"] is None for m in msgs[:-1])
    text = "".join(m["choices"][0].get("text") or m["choices"][0].get("delta", {}).get("content") or ""
                   for m in msgs if m["choices"])
    assert text


HI = [{"role": "user", "content": "hi"}]
BAD = [
    ("not json", None, 400, "JSON"),
    ({"messages": []}, None, 400, "messages"),
    ({"model": "tiny-chat"}, None, 400, "messages"),
    ({"messages": HI, "max_tokens": 0}, None, 400, "max_tokens"),
    ({"messages": HI, "max_tokens": 100000}, None, 400, "512"),
    ({"messages": HI, "temperature": 5}, None, 400, "temperature"),
    ({"messages": HI, "top_p": 0}, None, 400, "top_p"),
    ({"messages": HI, "n": 2}, None, 400, "only n=1"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, "role"),
    ({"messages": HI, "model": "gpt-9"}, None, 404, "gpt-9"),
    ({"messages": [{"role": "user", "content": "x " * 600}]}, None, 400, "max_request_tokens = 512"),
    ({"messages": HI, "stream": "true"}, None, 400, "stream"),
    ({"messages": HI, "temperature": "0.5"}, None, 400, "temperature"),
    ({"messages": HI, "max_tokens": "5"}, None, 400, "max_tokens"),
    ({"messages": HI, "ignore_eos": 1}, None, 400, "ignore_eos"),
    ({"messages": HI, "stream_options": {"include_usage": "yes"}}, None, 400, "include_usage"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None, 400,
     "'image_url' are not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]}, None, 400,
     "'input_audio' are not supported"),
    ({"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}]}, None, 400, "tools"),
    ({"messages": HI, "functions": [{"name": "f"}]}, None, 400, "functions"),
    ({"messages": HI, "response_format": {"type": "json_object"}}, None, 400, "json_object"),
    ({"messages": HI, "top_logprobs": 2}, None, 400, "logprobs"),
    ({"messages": HI, "logprobs": True, "top_logprobs": 50}, None, 400, "top_logprobs"),
    ({"messages": HI, "presence_penalty": 3}, None, 400, "presence_penalty"),
    ({"messages": HI, "repetition_penalty": 0}, None, 400, "repetition_penalty"),
]


@pytest.mark.parametrize("body, _, status, text", BAD, ids=[f"{s}-{t}" for _, _, s, t in BAD])
def test_bad_input_gets_its_status_and_message(server, body, _, status, text):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert text in err["message"] and err["type"]


BAD_COMPLETIONS = [
    ({"prompt": [1, 2, 49152]}, "[0, 49152)"),
    ({"prompt": [1, -1]}, "[0, 49152)"),
    ({"prompt": []}, "empty list"),
    ({"prompt": ""}, "must not be empty"),
    ({"prompt": 5}, "string or a list of integer token ids"),
    ({"prompt": [1, "2"]}, "string or a list of integer token ids"),
    ({"prompt": [1.0, 2.0]}, "string or a list of integer token ids"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": [[1, 2]]}, "one prompt per request"),
    ({"prompt": "hi", "logprobs": True}, "logprobs"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "hi", "seed": "1"}, "seed"),
    ({"prompt": "hi", "stop": 3}, "stop"),
]


@pytest.mark.parametrize("body, text", BAD_COMPLETIONS, ids=[json.dumps(b) for b, _ in BAD_COMPLETIONS])
def test_bad_completions_input_gets_400_and_message(server, body, text):
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert text in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [1, 2, 49152]}, "prompt"),
    ("/v1/completions", {"prompt": "x " * 600}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x " * 600}]}, "max_tokens"),
    ("/v1/chat/completions", "{not json", None),
])
def test_error_names_the_parameter_of_its_endpoint(server, path, body, param):
    r = httpx.post(f"{server.url}{path}", content=body if isinstance(body, str) else json.dumps(body),
                   headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_accepted_and_ignored_fields(server):
    """Fields that ask for nothing here (user, unknown vendor fields, a text response_format, no tools, one choice, no
    logprobs, nulls, samplers off) are taken, and the answer is the one without them: same text, no logprobs."""
    def ask(body: dict) -> dict:
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": HI, "max_tokens": 4, "ignore_eos": True,
                                                                   **body}, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    ignored = {"user": "u-1", "response_format": {"type": "text"}, "tool_choice": "none", "some_vendor_field": {"x": 1},
               "n": 1, "logprobs": False, "stop": None, "seed": None}
    off = {"top_k": -1, "top_p": None}  # the samplers' off values: as if not sent
    for sampling in ({"temperature": 0}, {"temperature": 1, "seed": 7}):
        plain, full = ask(sampling), ask({**ignored, **sampling, **off})
        assert len(full["choices"]) == 1 and full["choices"][0]["logprobs"] is None, full
        assert full["choices"][0]["message"] == plain["choices"][0]["message"], (full, plain)
        assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("backend", ["naive", "batcher"])
def test_generate_backends_take_the_same_format_and_refuse_per_row_extras(chat_model, backend):
    with Server(*chat_model, BACKENDS[backend]) as s:
        parts = [{"type": "text", "text": "hi"}]
        ok = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": parts}],
                        "max_tokens": 3, "ignore_eos": True, "repetition_penalty": 1.0, "logprobs": False}, timeout=30)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        for extra, field in [({"logprobs": True}, "logprobs"), ({"presence_penalty": 0.5}, "presence_penalty"),
                             ({"repetition_penalty": 1.2}, "repetition_penalty")]:
            r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, **extra}, timeout=10)
            assert r.status_code == 400 and field in r.json()["error"]["message"], r.text
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": HI, "stream": "yes"}, timeout=10)
        assert r.status_code == 400 and "stream" in r.json()["error"]["message"]


def test_api_key(chat_model):
    with Server(*chat_model, PolicySpec.of("continuous", 2), api_key="sekret") as s:
        with pytest.raises(openai.AuthenticationError):
            client(s, "wrong").models.list()
        assert client(s, "sekret").models.list().data[0].id == "tiny-chat"
        assert httpx.get(f"{s.url}/health").status_code == 200  # health needs no key
