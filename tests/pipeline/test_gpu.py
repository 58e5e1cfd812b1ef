"""On one CUDA device (`make gpu-check`; skipped with its reason elsewhere): token equality with Hugging Face
`generate` on both tiny architectures in fp32 and, by the near-tie rule of tests/engine/model/test_bf16.py, in bf16;
a server answering with the API's default sampling (temperature 1); the engine speed case at B=1 and B=64 (no speed bar:
the figures are printed)."""
import pytest
import torch

from engine.factory import build_net, load_source
from engine.model.hf import generate_alone
from engine.model.loader import pad_id
from engine.specs import PrecisionSpec
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, run_scenario, scenario_prompts
from pipeline.measuring.timing import engine_case, hf_case
from pipeline.workloads.prompts import prompts_for
from tests.conftest import TINY, model_cfg
from tests.engine.model.test_bf16 import agreement
from tests.serving import BACKENDS, Server, client

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=[(name, dtype) for name in TINY for dtype in ("float32", "bfloat16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def on_cuda(request):
    name, dtype = request.param
    model, _ = load_source(model_cfg(name), PrecisionSpec(dtype=dtype, device="cuda"))
    prompts = scenario_prompts(model, None)
    return f"{name} {dtype}", model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_tokens_on_cuda(on_cuda, policy):
    label, model, prompts, ref = on_cuda
    out = run_scenario(model, policy, prompts, LENS, ARRIVE)
    if model.dtype == torch.float32:
        assert [out[str(i)] for i in range(len(ref))] == ref, f"{label} {policy.name}"
    else:
        print(label, policy.name, agreement(f"{label} {policy.name}", model, prompts, ref, out), "of", LENS)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_server_default_sampling_on_cuda(smollm2_tokenizer_dir, backend):
    cfg = model_cfg("tiny-chat", tokenizer=str(smollm2_tokenizer_dir))
    model, tok = load_source(cfg, PrecisionSpec(dtype="float32", device="cuda"))
    with Server(model, tok, BACKENDS[backend]) as s:
        r = client(s).chat.completions.create(model="tiny-chat", max_tokens=8,
                                              messages=[{"role": "user", "content": "hi"}])
        assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize("batch", [1, 64])
def test_engine_speed_case_on_cuda(smollm2_tokenizer_dir, batch):
    cfg = model_cfg("smollm2-135m", path=str(smollm2_tokenizer_dir))
    model, tok = load_source(cfg, PrecisionSpec(dtype="bfloat16", device="cuda"))
    prompts = prompts_for("chat", batch, tok, model.config.vocab_size)
    row = {**engine_case(build_net(model), prompts, 32, 1), **hf_case(model, prompts, 32, 1, pad_id(tok))}
    print({k: row[k] for k in ("batch", "engine_tps", "hf_tps", "engine_decode_tps", "engine_peak_mb")})
    assert row["engine_tps"] > 0 and row["hf_tps"] > 0
