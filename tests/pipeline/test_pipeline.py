"""The whole pipeline on a tiny model in a temporary copy of the repository: dvc repro with sane figures, a no-op
second repro, the machine as a dependency of every measured stage, and a DVC experiment whose metrics diff shows
the changed figures."""
import json
import re
import time

import pytest

from pipeline.tools.scratch import SMALL, scratch_copy, sh

REPORTS = ["REPORT.md", "HARDWARE.md", "SCOREBOARD.md", "metrics.json", "engine_speed.json", "equivalence.json",
           "hardware.json", "machine.json", "plots/engine_throughput_vs_ttft.png", "plots/throughput_vs_ttft.png",
           "plots/prefill_stall.png", "plots/kv_memory.png", "plots/shared_prefix.png", "fleet/FLEET.md",
           "fleet/plots/gpus_vs_rate.png"]
MEASURED = ["probe_hardware", "check_equivalence", "engine_speed", "bench_engine", "bench_cache",
            "bench_server", "bench_speculation"]  # stages that measure: each depends on reports/machine.json


def ran(out: str) -> set[str]:
    """The stages a `dvc repro` ran, from its output."""
    return set(re.findall(r"Running stage '([^']+)'", out))


@pytest.mark.slow
def test_dvc_repro_on_a_tiny_model(tmp_path, smollm2_tokenizer_dir):
    overrides = ["model=tiny-chat", *SMALL]
    repo = scratch_copy(tmp_path, overrides, {"smollm2-135m": smollm2_tokenizer_dir})  # tiny-chat's tokenizer
    t = time.perf_counter()
    sh("dvc repro", repo)
    first = time.perf_counter() - t
    for name in REPORTS:
        assert (repo / "reports" / name).exists(), name
    metrics = json.loads((repo / "reports" / "metrics.json").read_text())
    equal = {k: v for k, v in metrics.items() if k.startswith("equivalence.")}
    assert len(equal) == 7 and set(equal.values()) == {1.0}, equal  # every policy 6/6 token-equal
    tput = {k: v for k, v in metrics.items() if k.endswith(".throughput_tps") and "no_deadline" not in k}
    assert tput and min(tput.values()) > 0, tput
    assert metrics["server.hf-static_(no_deadline).c4.throughput_tps"] == 0  # break-it: no batch fills, none ends
    # continuous never pads a row; static pads each batch to its longest request (lognormal lengths): counted, not timed
    assert metrics["all_policies.continuous.slot_efficiency"] == 1.0 > metrics["all_policies.static.slot_efficiency"]
    sizes = {k.split(".")[2] for k in metrics if k.startswith("shared_prefix.S512.N")}
    assert len(sizes) == 2, sizes
    for n in (int(size[1:]) for size in sizes):  # prefix caching: hits as computed from the prompts; none without
        assert metrics[f"shared_prefix.S512.N{n}.cached.cached_tokens"] == \
            metrics[f"shared_prefix.S512.N{n}.cached.expected_cached_tokens"] > 0
        assert f"shared_prefix.S512.N{n}.uncached.cached_tokens" not in metrics or \
            metrics[f"shared_prefix.S512.N{n}.uncached.cached_tokens"] == 0
    speed = [k for k in metrics if k.startswith("engine_speed.") and k.endswith(".bytes_fraction_here")]
    assert speed and all(0 <= metrics[k] < 10 for k in speed), speed  # each case against its own bandwidth reading
    assert metrics["fleet.errors"] == 0 and "fleet.azure-conv.prefix_aware.ttft_p99_s" in metrics  # through the router
    spec = {k: v for k, v in metrics.items() if k.startswith("speculation.") and k.endswith(".throughput_ratio")}
    assert len(spec) == 2 * 2 * 3 and all(v > 0 for v in spec.values()), spec  # workloads x batches x ks, each timed
    preempted = {k: v for k, v in metrics.items() if k.startswith("preemption.") and k.endswith(".preemptions")}
    assert preempted["preemption.blocks48.preemptions"] > 0 == min(preempted.values()), preempted  # the big pool: none
    machine = json.loads((repo / "reports" / "machine.json").read_text())
    assert machine["label"] in (repo / "reports" / "REPORT.md").read_text()
    assert machine["label"] in (repo / "reports" / "HARDWARE.md").read_text()
    (repo / "reports" / "machine.json").write_text(json.dumps({**machine, "id": "0", "cpu": "another CPU"}))
    status = sh("dvc status", repo)  # another machine's fingerprint: every measured stage is out of date
    assert all(f"{stage}:" in status for stage in MEASURED), status
    assert ran(sh("dvc repro", repo)) == {"fingerprint"}  # this machine again: a no-op, nothing else reruns
    sh("git add -A && git commit -qm results", repo)
    again = " ".join(f"-S '{o}'" for o in overrides)  # dvc exp run composes params.yaml anew: every override again
    exp = ran(sh(f"dvc exp run {again} -S bench.engine_speed.repeats=1", repo))
    assert "engine_speed" in exp and not any(s.startswith("bench_") for s in exp), exp  # only what reads the param
    diff = sh("dvc metrics diff", repo)
    assert "engine_speed.fp32.b1_" in diff, diff
    assert "server.engine-continuous.c64.throughput_tps" in metrics
    print(f"dvc repro on the tiny model: {first:.0f} s")  # a figure for the notes, not a timed assertion
