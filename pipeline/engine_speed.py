"""Stage engine_speed: the engine against Hugging Face `generate` on the same model, dtype and requests, one process
(pipeline.speed). One warm-up first, not reported. Each row's engine decode rate is also set against this machine's
floor for that batch: the model's matrix products alone, on the engine's kernels (speed.step_floor_ms, as
probe_hardware measures it), run after each engine run for as many steps as its decode (floor_tps, floor_fraction);
burst_floor_tps: their best single step, timed just before and after the case (a rate no sustained run reaches on a
shared machine).
Writes reports/engine_speed.json: {"machine", "rows"}."""
import json

import torch

from engine.loader import eos_ids
from engine.model import FlatModel
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json
from pipeline.prompts import prompts_for
from pipeline.speed import engine_run, hf_generate, run_case, step_floor_ms, warm_compiled


def main(cfg) -> list[dict]:
    torch.manual_seed(int(cfg.seed))
    model, tokenizer = load_configured_model(cfg)
    eos = eos_ids(model)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    bench = cfg.bench.engine_speed
    compile, graphs = bool(bench.compile or cfg.precision.compile), bool(cfg.precision.graphs)
    warm = prompts_for("chat", 2, tokenizer, model.config.vocab_size)
    engine_run(model, warm, 8, eos, compile, graphs=graphs)  # warm-up, not reported
    if compile:
        warm_compiled(model, max(int(case["batch"]) for case in bench.cases), eos, graphs)
    hf_generate(model, warm, 8, pad_id)
    net, rows = FlatModel.of(model), []
    for case in bench.cases:
        B = int(case["batch"])
        before = step_floor_ms(net, B)
        row = run_case(model, tokenizer, dict(case), int(bench.repeats), eos, pad_id, compile, graphs)
        row["burst_floor_tps"] = B / min(before, step_floor_ms(net, B)) * 1e3
        rows.append({**row, "model": cfg.model.name, "dtype": cfg.precision.dtype})
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    write_json(ROOT / "reports" / "engine_speed.json",
               {"machine": environment(cfg.threads, cfg.precision.device), "rows": rows})
    return rows


if __name__ == "__main__":
    main(load())
