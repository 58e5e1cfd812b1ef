"""The fleet simulator: replicas of the real engine on one virtual time line behind the router. One replica is the
single-engine simulator exactly; every request is served once, by the replica the router chose."""
import json

import pytest
from omegaconf import OmegaConf

from engine.core.simulator import CostModel
from engine.router import POLICIES, RouterSpec
from pipeline.config import compose_config
from pipeline.modeling.fleet import Split, simulate_fleet
from pipeline.modeling.simulation import simulate
from pipeline.tools import fleet
from pipeline.workloads.generate import build

COST = CostModel(0.01, {"num_prompt_tokens": 2e-5, "num_decode_rows": 1e-4, "prompt_attention": 1e-9})
STEP = 0.012  # s: the load's unit


def run(policy: str, kv: str = "paged", **over):
    cfg = compose_config(["model=tiny-llama", "workload=mooncake-conv", "workload.num_requests=24",
                          "profile.requests_scale=1", f"policy={policy}", f"kv={kv}", "load.multiple=3",
                          *[f"{k}={v}" for k, v in over.items()]])
    return cfg, build(cfg, None, 512)


@pytest.mark.parametrize("policy", ["continuous", "chunked"])
def test_one_replica_is_the_single_engine_simulation(policy):
    cfg, wl = run(policy)
    args = (COST, OmegaConf.to_container(cfg.policy), wl, STEP, int(cfg.max_request_tokens), 1.0, 0.1)
    one = simulate(*args, kv=OmegaConf.to_container(cfg.kv))
    fleet = simulate_fleet(*args, 1, RouterSpec("round_robin"), kv=OmegaConf.to_container(cfg.kv))
    assert {k: fleet[k] for k in one} == one and fleet["served"] == [len(wl)]
    assert 0 < fleet["prefix_hit_rate"] == one["cached_tokens"] / wl["prompt_tokens"].sum()


@pytest.mark.parametrize("router", POLICIES)
def test_every_request_is_served_once_by_the_fleet(router):
    cfg, wl = run("continuous")
    out = simulate_fleet(COST, OmegaConf.to_container(cfg.policy), wl, STEP, int(cfg.max_request_tokens), 1.0, 0.1,
                         3, RouterSpec(router, block_tokens=16), kv=OmegaConf.to_container(cfg.kv))
    assert out["complete"] == out["requests"] == len(wl) == sum(out["served"])
    assert out["tokens"] == wl["output_tokens"].sum()


def test_a_request_level_batcher_in_a_fleet_waits_for_its_deadline():
    cfg, wl = run("dynamic", kv="slot", **{"policy.max_batch": 8, "policy.max_wait_ms": 40})
    out = simulate_fleet(COST, OmegaConf.to_container(cfg.policy), wl, STEP, int(cfg.max_request_tokens), 1.0, 0.1,
                         2, RouterSpec("round_robin"))
    assert out["complete"] == len(wl) and out["served"] == [12, 12]


def test_more_replicas_serve_the_same_load_sooner():
    cfg, wl = run("continuous", **{"load.multiple": 12})
    rows = [simulate_fleet(COST, OmegaConf.to_container(cfg.policy), wl, STEP, int(cfg.max_request_tokens), 1.0,
                           0.1, n, RouterSpec("least_loaded"), kv=OmegaConf.to_container(cfg.kv)) for n in (1, 4)]
    assert rows[1]["ttft_p99_s"] < rows[0]["ttft_p99_s"] and rows[1]["wall_s"] <= rows[0]["wall_s"]


def test_the_fleet_tool_computes_each_router_and_refuses_what_it_cannot(capsys):
    fleet.main(["hardware=h100-sxm", "model=llama-3.1-8b-shape", "precision=bf16-cuda", "workload=azure-conv",
                "replicas=2", "requests=30", "seconds=1", "routers=round_robin,prefix_aware",
                "router.cache_threshold=0.5",
                "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["computed"] and [r["router"] for r in out["rows"]] == ["round_robin", "prefix_aware"]
    assert all(sum(r["served"]) == r["complete"] == 30 for r in out["rows"])
    for bad, said in ((["routers=random"], "choose one of"), (["router.nope=1"], "unknown router knob"),
                      (["hardware=cpu"], "spec sheet"), (["split=2x2"], "<P>P<D>D")):
        with pytest.raises(SystemExit) as err:
            fleet.main(["hardware=h100-sxm", "model=llama-3.1-8b-shape", "precision=bf16-cuda", *bad])
        assert said in str(err.value)


def split_run(wl, cfg, split, **kw):
    return simulate_fleet(COST, OmegaConf.to_container(cfg.policy), wl, STEP, int(cfg.max_request_tokens), 1.0, 0.1,
                          split.prefill + split.decode, RouterSpec("round_robin"), kv=OmegaConf.to_container(cfg.kv),
                          split=split, **kw)


def test_prefill_and_decode_apart_hand_each_prompt_over_once():
    """Each request's prompt is computed on a prefill replica, its K/V found on the decode replica (only the last
    partial block and the first token computed there), its tokens all arrive, the hand-over's time between the
    first and the second."""
    cfg, wl = run("chunked", **{"kv.block_size": 16})
    split = Split(1, 2, link_bytes_s=1e6, latency_s=0.05, kv_bytes_per_token=1000)
    out = split_run(wl, cfg, split)
    assert out["complete"] == len(wl) and out["tokens"] == wl["output_tokens"].sum()
    assert out["served"][0] == len(wl) and sum(out["served"][1:]) == (wl["output_tokens"] > 1).sum()
    assert out["handovers_recomputed"] == 0 and out["split"] == "1P2D"
    again = (wl["prompt_tokens"] % 16 + 1)[wl["output_tokens"] > 1].sum()  # decode side: partial block + token 1
    assert out["prompt_tokens_computed"] == wl["prompt_tokens"].sum() - out["cached_tokens"] + again
    assert out["recomputed_tokens"] == again and out["prefix_hit_rate"] > 0
    assert split.handover_s(1000) == pytest.approx(0.05 + 1.0)


def test_a_decode_pool_without_room_computes_the_prompt_again():
    cfg, wl = run("chunked", **{"kv.block_size": 16, "kv.num_blocks": 40})  # room for about one request
    out = split_run(wl, cfg, Split(1, 1, 1e12, 0.0, 1))
    assert out["handovers_recomputed"] > 0 and out["complete"] == len(wl)


def test_a_run_that_cannot_meet_its_slo_stops_early():
    cfg, wl = run("continuous", **{"load.multiple": 40})
    args = (COST, OmegaConf.to_container(cfg.policy), wl, STEP / 40, int(cfg.max_request_tokens), 0.05, 0.1, 1,
            RouterSpec("round_robin"))
    whole, probe = simulate_fleet(*args, kv="paged"), simulate_fleet(*args, kv="paged", most_late=0)
    assert whole["complete"] == len(wl) and probe["complete"] < len(wl) and probe["steps"] < whole["steps"]
