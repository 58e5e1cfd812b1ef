"""Bad input at the engine's API: a clear error naming the field and the limit; nothing admitted half-way."""
import pytest

from engine import RequestError, SamplingParams
from engine.factory import build_engine
from engine.specs import PolicySpec


@pytest.fixture()
def engine(tiny_llama):
    return build_engine(tiny_llama, PolicySpec.of("continuous", 2), max_request_tokens=32, eos_ids=[2])


@pytest.mark.parametrize("prompt, params, field, text", [
    ([], SamplingParams(), "prompt", "non-empty"),
    ([1, 2, 99999], SamplingParams(), "prompt", "[0, 512)"),
    ([5] * 10, SamplingParams(max_new_tokens=0), "max_new_tokens", ">= 1"),
    ([5] * 20, SamplingParams(max_new_tokens=13), "max_new_tokens", "max_request_tokens = 32"),
    ([5], SamplingParams(temperature=-1.0), "temperature", "[0, 100]"),
    ([5], SamplingParams(top_p=0.0), "top_p", "(0, 1]"),
    ([5], SamplingParams(top_k=10**6), "top_k", "[0, 512]"),
    ([5], SamplingParams(seed=-3), "seed", "2**63"),
])
def test_bad_request_is_refused_with_field_and_limit(engine, prompt, params, field, text):
    with pytest.raises(RequestError) as err:
        engine.add_request("bad", prompt, params)
    assert err.value.field == field and text in str(err.value)
    assert not engine.has_work() and "bad" not in engine.scheduler.requests


def test_engine_serves_others_after_a_refusal(engine):
    good = engine.add_request("good", [5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True))
    with pytest.raises(RequestError):
        engine.add_request("bad", [5] * 40, SamplingParams(max_new_tokens=4))
    with pytest.raises(RequestError, match="already"):
        engine.add_request("good", [5], SamplingParams())
    while engine.has_work():
        engine.step()
    assert len(good.output) == 4 and good.finish_reason == "length"


def first_fresh(tokens: list[int]) -> int:
    """Index of the first token, after the first, that has not appeared before it."""
    return next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])


def test_eos_stops_unless_ignored(tiny_llama):
    """EOS ends a request on its first appearance; under ignore_eos it is never emitted (as min_new_tokens does in
    generate) and the request runs to max_new_tokens; a stop token ends it even then."""
    probe = build_engine(tiny_llama, PolicySpec.of("continuous", 1), max_request_tokens=64).generate(
        [[5, 6]], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    k = first_fresh(probe)
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 2), max_request_tokens=64, eos_ids=[probe[k]])
    free = eng.add_request("free", [5, 6], SamplingParams(max_new_tokens=40))
    forced = eng.add_request("forced", [5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True))
    while eng.has_work():
        eng.step()
    assert free.output == probe[:k + 1] and free.finish_reason == "stop"
    assert forced.output[:k] == probe[:k] and probe[k] not in forced.output
    assert len(forced.output) == 40 and forced.finish_reason == "length"
    m = first_fresh(forced.output)
    stopper = eng.add_request("stopper", [5, 6], SamplingParams(max_new_tokens=40, ignore_eos=True,
                                                                 stop_token_ids=(forced.output[m],)))
    ev = []
    while eng.has_work():
        ev += eng.step()
    assert ev[-1].finish_reason == "stop" and ev[-1].token == forced.output[m]
    assert stopper.output == forced.output[:m + 1]


def test_several_eos_ids_each_stop(tiny_llama):
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 1), max_request_tokens=64, eos_ids=[])
    probe = eng.generate([[5, 6]], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    j = first_fresh(probe)
    unused = next(t for t in range(3, 512) if t not in probe)
    eng = build_engine(tiny_llama, PolicySpec.of("continuous", 1), max_request_tokens=64,
                    eos_ids=[unused, probe[j]])
    out = eng.generate([[5, 6]], SamplingParams(max_new_tokens=30))[0]
    assert out == probe[:j + 1]
