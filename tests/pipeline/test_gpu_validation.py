"""The computed GPU figures stand on named inputs: every spec sheet and published run carries its source, every
calibrated term reproduces the run it was solved on, the method's error against the other runs stays within its bar,
and the steptime command answers, or refuses with the options."""
import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from pipeline.config import ROOT, group_entry, options
from pipeline.modeling import gpu_validation as gv
from pipeline.modeling.cost_fit import first_principles
from pipeline.modeling.roofline import Roofline, Shape
from pipeline.tools.steptime import main

GPUS = sorted(gv.gpu_entries())
FIELDS = ("id", "source", "address", "engine", "hardware", "gpus", "model", "batch", "input_tokens", "output_tokens",
          "metric", "value", "quote")


def test_every_published_run_names_its_source_shape_and_a_known_gpu_and_model():
    figs = gv.figures()
    assert len({f["id"] for f in figs}) == len(figs)
    for f in figs:
        assert all(f.get(k) not in (None, "") for k in FIELDS), f["id"]
        assert f["hardware"] in GPUS and f["model"] in options("model"), f["id"]


@pytest.mark.parametrize("gpu", GPUS)
def test_each_spec_sheet_has_its_sources_and_each_calibrated_term_reproduces_its_run(gpu):
    entry = group_entry("hardware", gpu)
    assert entry["sources"]["sheet"] and entry["bandwidth_gbs"] > 0 and entry["tflops"]["bf16"] > 0
    figs = {f["id"]: f for f in gv.figures()}
    for term, run_id in gv.calibration_runs(entry).items():
        fig = figs[run_id]
        if fig["hardware"] == gpu:  # a shared term is checked on its own GPU
            assert gv.computed(fig, gv.roofline(fig)) == pytest.approx(fig["value"], rel=5e-3), (term, run_id)


def test_the_method_within_its_bar_against_runs_it_was_not_calibrated_on():
    """At least 12 runs from at least 3 sources that calibrated nothing; median |error| <= 15 %."""
    got = gv.validate()
    st = got["stats"]
    assert st["figures_from_sources_not_calibrating"] >= 12 and st["sources_not_calibrating"] >= 3
    assert st["median_abs_rel_error"] <= 0.15
    counted = [r for r in got["figures"] if not r["calibration"] and not r["excluded"]]
    assert len(counted) == st["figures"] and all(np.isfinite(r["computed"]) for r in counted)


def steptime(*args):
    return subprocess.run([sys.executable, "-m", "pipeline.tools.steptime", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_steptime_answers_a_batch_in_json_and_refuses_what_it_cannot_compute(capsys):
    out = steptime("hardware=h100-sxm", "model=llama-3.1-8b-shape", "precision=bf16-cuda", "batch=8",
                   "input_tokens=32", "output_tokens=128", "--json")  # the command itself, once
    got = json.loads(out.stdout)
    assert got["computed"] and got["end_to_end_s"] > got["ttft_s"] > 0 and got["steps"] == 128
    main(["hardware=h100-sxm", "model=llama-3.1-70b-shape", "precision=bf16-cuda", "tp=4", "decode=64", "context=2048"])
    step = capsys.readouterr().out
    assert "all_reduce" in step and "memory-bound" in step
    for argv, named in ((["hardware=tpu-v9", "decode=1"], "h100-sxm"),  # the options listed
                        (["hardware=cpu", "decode=1"], "spec sheet"),
                        (["hardware=h100-sxm", "model=llama-3.1-70b-shape", "precision=bf16-cuda", "batch=1"],
                         "tp=2")):  # 141 GB of weights on one 80 GB GPU
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert named in str(refused.value), (argv, refused.value)


def test_first_principles_on_this_cpu_judged_on_recorded_steps():
    shape = Shape(2, 64, 4, 2, 16, 128, 512, False, (None, None))
    roof = Roofline(shape, 50e9, 100e9, 4, 4)
    steps = pd.DataFrame({"kind": ["decode", "prefill"], "num_decode_rows": [4, 0], "num_sampled_rows": [4, 2],
                          "decode_attention": [4 * 100, 0], "num_prompt_tokens": [0, 64]})
    exact = [roof.seconds([(1, 99, True)] * 4), roof.seconds([(32, 0, True)] * 2)]
    got = first_principles(roof, steps.assign(duration=exact))
    assert got["computed"] and got["median_rel_error"] == pytest.approx(0.0, abs=1e-12)
    half = first_principles(roof, steps.assign(duration=[2 * t for t in exact]))
    assert half["per_kind"]["decode"]["median_rel_error"] == pytest.approx(0.5)
