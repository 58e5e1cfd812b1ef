"""Device-correct without a GPU: the model (and so its cache) on the `meta` device. A tensor made on the CPU by mistake
meets a meta tensor and raises a device mismatch; a device-clean path runs until its first read-back of values, which
meta tensors refuse ("Cannot copy out of meta tensor", or ".item() cannot be called on meta tensors"). Each case must
end in that read-back, nothing earlier."""
import pytest
import torch

from engine import SamplingParams
from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.factory import build_engine, build_net, load_source
from engine.model.hf import generate_padded
from engine.model.kv_cache import make_cache
from engine.model.runner import ModelRunner
from engine.specs import PolicySpec
from pipeline.measuring.cache import append_s
from pipeline.measuring.timing import step_floor_ms
from tests.conftest import TINY, model_cfg

READ_BACK = "Cannot copy out of meta tensor|cannot be called on meta tensors"  # .tolist() / .item()
STEPS = {  # every kind of step the runner meets: (rid, seat, start, tokens, sample, prompt)
    "prefill": [("a", 0, 0, (5, 6, 7), True, True), ("b", 1, 0, (5, 6), True, True)],
    "prefill of equal prompts": [("a", 0, 0, (5, 6, 7), True, True), ("b", 1, 0, (8, 6, 9), True, True)],
    "decode": [("a", 0, 5, (5,), True, False), ("b", 1, 7, (6,), True, False)],
    "decode, a seat between": [("a", 0, 5, (5,), True, False), ("b", 2, 7, (6,), True, False)],
    "mixed": [("a", 0, 5, (5,), True, False), ("b", 1, 0, (5, 6, 7), True, True)],
    "chunk after a cached part": [("a", 0, 5, (5,), True, False), ("b", 1, 4, (5, 6, 7), False, True),
                                  ("c", 2, 3, (9, 9), True, True)],
}
SAMPLING = {"greedy": SamplingParams(), "ignore_eos": SamplingParams(ignore_eos=True),
            "sampled": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3)}


@pytest.fixture(scope="module", params=TINY)
def meta_model(request):
    model, _ = load_source(model_cfg(request.param))
    return model.to("meta")


def plan_of(kind: str, params: SamplingParams) -> SchedulerOutput:
    return SchedulerOutput(tuple(ScheduledChunk(rid, start, tokens, sample, prompt, seat=seat,
                                                params=params if sample else None)
                                 for rid, seat, start, tokens, sample, prompt in STEPS[kind]))


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("kind", list(STEPS))
def test_engine_step_is_device_clean(meta_model, kind, sampling):
    eng = build_engine(meta_model, PolicySpec.of("continuous", 4), 64, eos_ids=[2])
    with pytest.raises(NotImplementedError, match=READ_BACK):
        eng.runner.run(plan_of(kind, SAMPLING[sampling]))


def test_generate_reference_places_inputs_on_the_model_device(meta_model, monkeypatch):
    """HF generate meets meta weights with CPU ids without complaint (embedding lookups take host indices), so the
    placement is checked where it happens: what the reference hands to `generate`."""
    seen = {}
    monkeypatch.setattr(meta_model, "generate", lambda **kw: seen.update(kw))
    generate_padded(meta_model, [[5, 6, 7], [8, 9]], 2, pad_id=0)
    assert seen["input_ids"].device.type == seen["attention_mask"].device.type == "meta"
    assert seen["input_ids"].shape == (2, 3)


def test_stage_measurements_run_on_the_model_device(meta_model):
    """Timed regions with no read-back run to the end on meta: the probe's step floor and the cache append."""
    eng = build_engine(meta_model, PolicySpec.of("continuous", 16), 64)
    assert step_floor_ms(eng.runner.net, 4) >= 0
    assert append_s(eng.runner.cache, eng.runner.net, 10) >= 0
    assert eng.runner.cache.k[0].device.type == "meta"


class HostIndexRunner(ModelRunner):
    """A runner that builds its step's index tensors on the CPU, as code written for the CPU only would."""

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)


@pytest.mark.parametrize("kind", ["prefill", "decode, a seat between", "chunk after a cached part"])
def test_a_cpu_tensor_by_mistake_is_caught(meta_model, kind):
    """The check has teeth: the same steps with host-made index tensors fail on a device mismatch, before any
    read-back."""
    net = build_net(meta_model)
    runner = HostIndexRunner(net, make_cache("slot", net, 4, 64))
    with pytest.raises(RuntimeError, match="device") as err:
        runner.run(plan_of(kind, SamplingParams()))
    assert "meta" in str(err.value) and "copy out" not in str(err.value)
