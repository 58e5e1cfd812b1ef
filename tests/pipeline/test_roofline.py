"""Step time from first principles (pipeline/modeling/roofline.py) and the batch it times: seed 000's arithmetic
exactly, each roof where it should bind, tensor parallelism and windows, the batch's known plans equal to the real
scheduler's, and the memory that holds its K/V."""
import dataclasses

import pytest
from omegaconf import OmegaConf

from pipeline.config import CONF, compose_config
from pipeline.modeling.batch import chunk_step, decode_step, run_batch, scheduled_batch
from pipeline.modeling.computed import seats_table, step_table
from pipeline.modeling.machines import kv_tokens, spec_roofline
from pipeline.modeling.roofline import Efficiency, Shape


def roof(hardware="dgx-spark", model="llama-3.1-8b-shape", tp=None, eff=None):
    r = spec_roofline(compose_config([f"hardware={hardware}", f"model={model}", "precision=bf16-cuda"]), tp)
    return dataclasses.replace(r, eff=eff) if eff else r


def test_seed_000_step_table_is_its_arithmetic_at_efficiency_1():
    """Llama 3.1 8B in bf16 on the Spark (273 GB/s): 16.06 GB of weights -> 58.8 ms; 1,024 x 128 KiB of K/V a user
    -> 0.134 GB -> 0.49 ms each; by 64 users the K/V is about a third of the traffic."""
    rows = {r["batch"]: r for r in step_table(roof(eff=Efficiency()))}
    assert round(rows[1]["weights_gb"], 2) == 16.06
    assert rows[1]["kv_gb"] == pytest.approx(1024 * 128 * 1024 / 1e9)
    assert round((rows[2]["ideal_step_s"] - rows[1]["ideal_step_s"]) * 1e3, 2) == 0.49
    assert rows[1]["ideal_step_s"] == pytest.approx((16.0605e9 + 1024 * 131072) / 273e9, rel=1e-4)
    assert 0.3 < rows[64]["kv_share"] < 0.4 and rows[256]["kv_share"] > 0.5
    assert rows[256]["ideal_user_tps"] < 6  # "each user gets 5 tok/s"


def test_decode_is_memory_bound_and_a_long_prompt_compute_bound():
    r = roof("h100-sxm")
    one = r.parts([(1, 1023, True)])
    assert one["layers"]["bound"] == "memory" and one["attention"]["bound"] == "memory"
    assert r.parts([(4096, 0, True)])["layers"]["bound"] == "compute"
    # a step of B decodes costs the weights once: far less than B steps of one
    assert r.step_time(decode_step(64, 1024)) < 3 * r.step_time(decode_step(1, 1024))


def test_tensor_parallelism_splits_weights_and_kv_and_adds_all_reduces():
    one, two = roof("h100-sxm", "llama-3.1-70b-shape", 1), roof("h100-sxm", "llama-3.1-70b-shape", 2)
    assert two.weights_bytes() == pytest.approx(one.weights_bytes() / 2)
    assert two.kv_bytes_per_token() == pytest.approx(one.kv_bytes_per_token() / 2)
    parts = two.parts([(1, 1023, True)] * 8)
    assert "all_reduce" in parts and "all_reduce" not in one.parts([(1, 1023, True)] * 8)
    assert kv_tokens(one, 80) == 0 < kv_tokens(two, 80)  # 141 GB of weights: one 80 GB GPU holds none


def test_a_decode_kernel_without_gqa_sharing_reads_each_kv_head_once_per_query_head():
    """Llama 3.1 8B: 32 query heads over 8 K/V heads, so 4x the decode rows' K/V; a prompt chunk's stays as it was."""
    shared = roof("a100-80g")
    apart = dataclasses.replace(shared, kv_per_query_head=True)
    assert apart.parts([(1, 4095, True, 8)])["attention"]["bytes"] == 4 * shared.parts([(1, 4095, True, 8)])[
        "attention"]["bytes"]
    assert apart.parts([(512, 0, True)]) == shared.parts([(512, 0, True)])


def test_a_window_caps_the_kv_its_layers_read():
    cfg = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "mistral-7b-shape.yaml").config)
    windowed, full = Shape.of(cfg), Shape.of({**cfg, "sliding_window": None})
    assert windowed.kv_elements(2048) == full.kv_elements(2048)
    assert windowed.kv_elements(16384) == full.kv_elements(4096) < full.kv_elements(16384)


@pytest.mark.parametrize("batch, n_in, n_out", [(1, 1, 1), (1, 2048, 1), (8, 32, 128), (64, 500, 40)])
def test_a_batch_timed_from_its_known_plans_equals_the_scheduler(batch, n_in, n_out):
    r = roof("h100-sxm")
    fast, real = run_batch(r, batch, n_in, n_out), scheduled_batch(r, batch, n_in, n_out)
    assert fast == pytest.approx(real, rel=1e-12)
    assert real["steps"] == n_out


def test_memory_that_holds_fewer_requests_makes_the_rest_wait():
    r = roof("rtx-4090")
    free = run_batch(r, 64, 1024, 256)
    held = run_batch(r, 64, 1024, 256, kv_tokens=kv_tokens(r, 24))
    assert kv_tokens(r, 24) < 64 * 1280 and held["end_to_end_s"] > free["end_to_end_s"]
    with pytest.raises(ValueError, match="more K/V than the memory holds"):
        run_batch(r, 1, 100_000, 1, kv_tokens=kv_tokens(r, 24))


def test_chunked_prompts_cost_more_steps_and_the_same_compute():
    r = roof("h100-sxm")
    whole, chunked = run_batch(r, 4, 2048, 2), run_batch(r, 4, 2048, 2, token_budget=512)
    assert chunked["steps"] > whole["steps"] and chunked["ttft_s"] > whole["ttft_s"]
    assert r.step_time(chunk_step([(512, 0)])) < r.step_time(chunk_step([(2048, 0)]))


def test_seats_table_matches_seed_000s_memory_wall():
    """A 24 GB card with an 8B model's 16 GB of weights seats about 11 users at 4K; 70B needs two 80 GB GPUs."""
    rows = {(r["hardware"], r["model"]): r for r in seats_table({"precision": "bf16-cuda"}, "h100-sxm")}
    assert 8 <= rows["rtx-4090", "llama-3.1-8b-shape"]["seats_4096"] <= 13
    assert rows["h100-sxm", "llama-3.1-70b-shape"]["devices"] == 2
    assert rows["dgx-spark", "llama-3.1-8b-shape"]["seats_1024"] > 500
