"""Stage engine_speed: the engine at each precision level (bench.engine_speed.levels, the configured one first)
against Hugging Face generate on the same model and requests, in one process (reports/engine_speed.json)."""
import json

import torch

from engine import threads
from engine.config import ROOT, compose_config, engine_weights
from engine.model.forward import FlatModel
from engine.model.loader import load_model
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.timing import engine_speed
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        torch.manual_seed(int(cfg.seed))
        threads.govern(int(cfg.threads))
        names = list(dict.fromkeys([cfg.precision.name, *(cfg.bench.engine_speed.get("levels") or [])]))
        models, levels, skipped, tokenizer = {}, {}, {}, None
        for name in names:
            try:
                level = compose_config([f"model={cfg.model.name}", f"precision={name}"])
                pc = level.precision
                for dtype in (pc.dtype, pc.get("reference_dtype", pc.dtype)):
                    if (dtype, pc.device) not in models:
                        models[dtype, pc.device], tokenizer = load_model(cfg.model, dtype, pc.device)
                net = FlatModel(models[pc.dtype, pc.device], **engine_weights(level))
            except (ValueError, RuntimeError, AssertionError) as exc:  # not on this machine or model: said
                skipped[name] = f"{type(exc).__name__}: {exc}"
                print(f"{name}: not measured: {skipped[name]}", flush=True)
                continue
            levels[name] = (net, models[pc.get("reference_dtype", pc.dtype), pc.device], pc)
        probe = ROOT / "reports" / "hardware.json"
        bandwidth = json.loads(probe.read_text())["bandwidth_gbs"] if probe.exists() else None
        rows = [{**r, "model": cfg.model.name}
                for r in engine_speed(levels, tokenizer, cfg.bench.engine_speed, cfg.measure, bandwidth)]
        write_json(ROOT / "reports" / "engine_speed.json",
                   {"machine": environment(cfg.threads, cfg.precision.device), "rows": rows, "skipped": skipped})
