"""Production-shaped workloads: 10,000 draws of each hold its published quantiles within 3 %, the Mooncake-shaped
prompts hit the prefix cache at 40 % within 3 points, seeds reproduce, and lengths fit the context."""
import numpy as np
import pandas as pd
import pytest

from engine.factory import build_engine
from pipeline.config import compose_config, kv_spec, policy_spec
from pipeline.measuring.replay import replay
from pipeline.workloads import shapes
from pipeline.workloads.generate import build
from pipeline.workloads.prefixes import hit_ratio
from pipeline.workloads.shaped import raw_lengths

SHAPED = ["azure-conv", "azure-code", "mooncake-conv", "sharegpt"]
N = 10_000


def cfg(workload: str, *overrides):
    return compose_config(["model=tiny-llama", f"workload={workload}", *overrides])


@pytest.mark.parametrize("workload", SHAPED)
def test_quantiles_within_3_percent_of_the_table(workload):
    c = cfg(workload, f"workload.num_requests={N}", "profile=full", "profile.requests_scale=1")
    drawn = dict(zip(("input", "output"), raw_lengths(c, np.random.default_rng(0))))
    for side, lengths in drawn.items():
        table = c.workload[side]
        got = np.percentile(np.rint(lengths), list(table.percentiles))
        err = np.abs(got / np.asarray(table.tokens) - 1)
        print(f"{workload} {side}: max quantile error {err.max():.2%} over {len(lengths)} draws")
        assert len(lengths) == N and err.max() < 0.03, (list(table.tokens), got.tolist())


@pytest.mark.parametrize("workload", SHAPED)
def test_table_mean_near_the_published_mean(workload):
    """The piecewise-linear tables' means land near the published means (within 15 %: linear between the points
    overstates a convex tail, as Azure code's outputs between p90 and p99): the ends are sensible."""
    w = cfg(workload).workload
    for side in ("input", "output"):
        assert shapes.table_mean(w[side].percentiles, w[side].tokens) == pytest.approx(w[side].mean, rel=0.15)


def test_ends_below_the_first_and_above_the_last_quantile():
    p, v = shapes.knots([10, 30], [200, 400])
    assert p.tolist() == pytest.approx([0, 0.1, 0.3, 1]) and v.tolist() == pytest.approx([100, 200, 400, 1100])
    assert shapes.knots([50, 90], [10, 1000])[1][0] == 1  # the line would fall below 1 token: floored
    with pytest.raises(ValueError, match="strictly up"):
        shapes.knots([30, 10], [1, 2])


def test_mooncake_prefix_hit_ratio_within_3_points_of_40_percent():
    wl = build(cfg("mooncake-conv", f"workload.num_requests={N}", "profile=full", "profile.requests_scale=1"))
    assert len(wl) == N
    ratio = hit_ratio(list(wl["prompt"]), wl.attrs["prefix_block_tokens"])
    print(f"mooncake-conv: prefix hit ratio {ratio:.4f} over {N} prompts, blocks of {wl.attrs['prefix_block_tokens']}")
    assert abs(ratio - 0.40) < 0.03 and wl.attrs["prefix_hit_ratio"] == ratio


def test_conversations_share_prefixes_only_within_themselves():
    """mooncake-sessions: the same 40 % hit ratio, every hit found within the request's own conversation (the hit
    ratio of each conversation's prompts alone adds up to the whole's)."""
    wl = build(cfg("mooncake-sessions", "workload.num_requests=2000", "profile=full", "profile.requests_scale=1"))
    block, ratio = wl.attrs["prefix_block_tokens"], wl.attrs["prefix_hit_ratio"]
    alone = sum(hit_ratio(list(g["prompt"]), block) * g["prompt_tokens"].sum() for _, g in wl.groupby("session"))
    assert abs(ratio - 0.40) < 0.03 and wl["session"].nunique() == 64
    assert alone / wl["prompt_tokens"].sum() == pytest.approx(ratio)


def test_other_workloads_share_no_prefix():
    wl = build(cfg("azure-conv", "workload.num_requests=2000"))
    assert hit_ratio(list(wl["prompt"]), 16) == 0.0


@pytest.mark.parametrize("workload", SHAPED)
def test_same_seed_same_workload_other_seed_differs(workload):
    a, b = build(cfg(workload, "load=bursty")), build(cfg(workload, "load=bursty"))
    pd.testing.assert_frame_equal(a, b)
    other = build(cfg(workload, "load=bursty", "seed=1"))
    assert not other["prompt_tokens"].equals(a["prompt_tokens"])
    assert not other["arrival_steps"].equals(a["arrival_steps"])


@pytest.mark.parametrize("workload", SHAPED)
def test_scaled_lengths_fit_the_context_and_clipping_is_recorded(workload):
    c = cfg(workload, "workload.num_requests=3000", "max_request_tokens=256")
    wl = build(c)
    total = wl["prompt_tokens"] + wl["output_tokens"]
    assert (wl["prompt_tokens"] >= 1).all() and (wl["output_tokens"] >= 1).all() and (total <= 256).all()
    assert (wl["prompt"].map(len) == wl["prompt_tokens"]).all()
    assert wl.attrs["clipped"] == int(wl["clipped"].sum()) and wl.attrs["context_tokens"] == 256
    assert wl.attrs["lengths"] == f"{c.workload.label} lengths" + (f" / {c.workload.scale}" if c.workload.scale != 1
                                                                   else "")
    assert wl["is_long"].sum() == len(wl) // 10


def test_fit_context_keeps_the_output_up_to_half():
    inp, out, clipped = shapes.fit_context([100, 500, 10], [20, 400, 600], 512)
    assert inp.tolist() == [100, 256, 10] and out.tolist() == [20, 256, 256] and clipped.tolist() == [False, True, True]


def test_scale_divides_lengths_and_labels_them():
    full = build(cfg("azure-conv", "workload.scale=1", "max_request_tokens=8192"))
    c = cfg("azure-conv", "max_request_tokens=8192")
    eighth, (raw_in, raw_out) = build(c), raw_lengths(c, np.random.default_rng(0))
    assert eighth.attrs["lengths"] == "Azure conv lengths / 8" and full.attrs["lengths"] == "Azure conv lengths"
    assert (full["prompt_tokens"] == np.rint(raw_in)).all() and (full["output_tokens"] == np.rint(raw_out)).all()
    assert (eighth["prompt_tokens"] == np.maximum(1, np.rint(raw_in / 8))).all()
    assert (eighth["output_tokens"] == np.maximum(1, np.rint(raw_out / 8))).all()


def test_prompts_with_a_tokenizer_have_exact_lengths():
    from engine.model.loader import load_tokenizer
    c = compose_config(["model=tiny-chat", "workload=mooncake-conv", "workload.num_requests=8"])
    tok = load_tokenizer(c.model)
    wl = build(c, tok, len(tok))
    assert (wl["prompt"].map(len) == wl["prompt_tokens"]).all() and max(max(p) for p in wl["prompt"]) < len(tok)


def test_the_engines_prefix_cache_finds_the_planned_hits(tiny_llama):
    """One request at a time through paged blocks of the prefix block's size: the engine caches exactly the tokens
    the hit ratio counts."""
    c = cfg("mooncake-conv", "load=closed", "load.concurrency=1", "workload.num_requests=64", "kv=paged",
            "kv.block_size=8", "kv.num_blocks=4096", "policy.max_running=4")
    wl = build(c)
    eng = build_engine(tiny_llama, policy_spec(c.policy), 512, kv=kv_spec(c.kv))
    req, steps, _ = replay(eng, wl, step_s=0.001, concurrency=1)
    assert req["complete"].all() and wl.attrs["prefix_block_tokens"] == 8
    assert steps["cached_tokens"].sum() / wl["prompt_tokens"].sum() == pytest.approx(wl.attrs["prefix_hit_ratio"])
