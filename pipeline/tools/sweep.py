"""Hydra multirun over engine replays: any groups and knobs, one run per job, all the jobs one results table.

    python -m pipeline.tools.sweep -m policy=static,continuous load=poisson,gamma
    python -m pipeline.tools.sweep -m hydra/launcher=submitit_local policy=static,continuous   # jobs through submitit
    python -m pipeline.tools.sweep -m hydra/launcher=slurm hydra.launcher.partition=<name> ... # jobs on a SLURM cluster

Each job composes conf/ with its overrides, builds its seeded workload and replays it through the engine exactly as
stage bench_engine does, then saves run.json, run.parquet and run_steps.parquet in its own folder. When the sweep
ends, `Collect` merges them into sweep.json, sweep.parquet and sweep_steps.parquet (the format of
data/results/engine/<table>.*) and SWEEP.md in the sweep folder, data/results/sweeps/<date_time> by default.
A process runs one isa level (pipeline/isa.py): a multirun over levels needs a launcher that starts a process per job.
"""
import json
from pathlib import Path

import hydra
import pandas as pd
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import OmegaConf

from engine import threads
from pipeline import isa
from pipeline.config import load_net
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.replay import run_one, save_table
from pipeline.reporting.tables import sweep
from pipeline.results import write_text
from pipeline.workloads.generate import build, tokenizer_and_vocab


@hydra.main(config_path="../../conf", config_name="sweep", version_base="1.3")
def job(cfg) -> float:
    """One run; returns its throughput (tok/s) so Hydra's sweepers can optimise over it."""
    isa.apply(cfg.isa)
    hc = HydraConfig.get()
    tok, vocab = tokenizer_and_vocab(cfg)
    threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
    model, _ = load_net(cfg)
    row, req, st = run_one(model, cfg, build(cfg, tok, vocab), "sweep", " ".join(hc.overrides.task) or "default", {})
    meta = {"config": OmegaConf.to_container(cfg), "machine": environment(cfg.threads, cfg.precision.device)}
    save_table(Path(hc.runtime.output_dir), "run", [row], [req], [st], meta)
    return row["throughput_tps"]


class Collect(Callback):
    """At the end of a multirun: every job's run merged into one table in the sweep folder."""

    def on_multirun_end(self, config, **kwargs) -> None:
        root = Path(config.hydra.sweep.dir)
        done = sorted(root.glob("*/run.json"), key=lambda p: p.parent.name)
        if not done:
            print(f"sweep: no finished runs under {root}")
            return
        saved = [json.loads(p.read_text()) for p in done]
        rows = [s["rows"][0] for s in saved]
        fixed = [o for o in rows[0]["point"].split() if all(o in r["point"].split() for r in rows)]
        name = {r["point"]: " ".join(o for o in r["point"].split() if o not in fixed) or "default" for r in rows}
        rows = [{**r, "point": name[r["point"]]} for r in rows]  # runs named by what varies between them
        reqs = [pd.read_parquet(p.with_name("run.parquet")).assign(point=r["point"]) for p, r in zip(done, rows)]
        steps = [pd.read_parquet(p.with_name("run_steps.parquet")).assign(point=r["point"]) for p, r in zip(done, rows)]
        meta = {"fixed": fixed, "runs": [str(p.parent) for p in done], "machine": saved[0]["machine"]}
        save_table(root, "sweep", rows, reqs, steps, meta)
        md, _ = sweep(rows)
        write_text(root / "SWEEP.md",
                   f"# Sweep\n\n{len(rows)} runs of `python -m pipeline.tools.sweep -m`, one per job, "
                   f"all with `{' '.join(fixed) or 'the defaults'}`; results in {root}.\n\n{md}\n")
        print(md)


if __name__ == "__main__":
    job()
