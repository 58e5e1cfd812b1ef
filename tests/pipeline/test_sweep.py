"""Hydra multirun over engine replays, through submitit's local executor (the SLURM launcher's twin): every job
lands as one row of the merged sweep table, with its requests, in the bench_engine table format."""
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[2]


def test_slurm_launcher_composes():
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("sweep", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.timeout_min == 120 and "collect" in cfg.hydra.callbacks


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["basic", "submitit_local"])
def test_multirun_lands_in_one_table(tmp_path, launcher):
    out = subprocess.run(
        [sys.executable, "-m", "pipeline.tools.sweep", "-m", f"hydra/launcher={launcher}",
         f"hydra.sweep.dir={tmp_path}",
         "model=tiny-llama", "profile.requests_scale=1", "workload.num_requests=6", "workload.output.mean=6",
         "load=closed", "policy=dynamic,continuous"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    table = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["point"] for r in table["rows"]] == ["policy=dynamic", "policy=continuous"]
    assert all(r["complete"] == r["requests"] == 6 for r in table["rows"])
    reqs = pd.read_parquet(tmp_path / "sweep.parquet")
    assert sorted(reqs["point"].value_counts().tolist()) == [6, 6]
    assert "policy=continuous" in (tmp_path / "SWEEP.md").read_text()
