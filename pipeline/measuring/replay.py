"""Replay a saved workload through the engine on the wall clock: arrivals at their absolute times, every token timed;
one run's summary row, and a table of runs saved in the results format (used by bench_engine and sweeps). Where the
engine can run nothing until the next arrival or batching deadline, its clock skips the idle gap (LLMEngine.skip_to)
instead of sleeping through it: every step runs and is timed as it would, and no wall time passes idle."""
import hashlib
from dataclasses import fields

import numpy as np
import pandas as pd

from engine import SamplingParams
from engine.core.outputs import StepRecord
from engine.engine import LLMEngine
from engine.factory import build_engine
from engine.model.loader import eos_ids
from engine.specs import PolicySpec
from pipeline.config import kv_spec, policy_spec
from pipeline.measuring.disturbance import measured
from pipeline.measuring.metrics import slo_limits, summarize
from pipeline.results import write_json, write_parquet
from pipeline.workloads.generate import expected_prefix_hits, predicted_static_efficiency
from pipeline.workloads.runs import runs

STEP_FIELDS = [f.name for f in fields(StepRecord)]  # a step record's columns (its fields are all scalars)


def calibrate_step(net, seats: int, max_request_tokens: int, prompt_len: int = 32, steps: int = 6,
                   compile: bool = False, graphs: bool = False) -> float:
    """Median seconds of one full-batch decode step with `seats` rows (the unit of load and of the SLOs), compiled
    as the replays' steps are and warmed up first."""
    eng = build_engine(net, PolicySpec("continuous", seats), max_request_tokens, compile=compile, graphs=graphs)
    eng.warm_up()
    p = SamplingParams(max_new_tokens=steps + 2, ignore_eos=True)
    for i in range(seats):
        eng.add_request(f"c{i}", [3 + (i + j) % 50 for j in range(prompt_len)], p)
    eng.step()  # prefill
    for _ in range(steps):
        eng.step()
    durations = sorted(r.duration for r in eng.records[1:])
    return durations[len(durations) // 2]


def replay(engine: LLMEngine, workload: pd.DataFrame, step_s: float, concurrency: int | None = None,
           time_limit_s: float = 600.0, wait_until=None) -> tuple[pd.DataFrame, pd.DataFrame, float]:
    """Run the workload; returns (per-request records, per-step records, wall seconds).

    Open loop: request i arrives at arrival_steps[i] * step_s. Closed loop (`concurrency`): c requests start at 0
    and each finished request lets the next one in. A request still unfinished when nothing more can happen
    (a static batcher that never fills) or at `time_limit_s` is recorded as incomplete, not waited on forever.
    `wait_until(t)` brings engine time to t, reached only when no step can run before it (default: the engine's
    clock skips there; a simulation jumps its virtual clock).
    """
    wait_until = wait_until or engine.skip_to
    rows = workload.sort_values("arrival_steps", kind="stable").to_dict("records")
    if concurrency:
        for i, r in enumerate(rows):
            r["arrival_s"] = 0.0 if i < concurrency else None
    else:
        for r in rows:
            r["arrival_s"] = float(r["arrival_steps"]) * step_s
    reqs, nxt = {}, 0
    engine.restart()
    steps = []
    while True:
        now = engine.now()
        while nxt < len(rows) and rows[nxt]["arrival_s"] is not None and rows[nxt]["arrival_s"] <= now:
            r = rows[nxt]
            reqs[r["rid"]] = engine.add_request(r["rid"], np.asarray(r["prompt"]).tolist(),
                                                SamplingParams(max_new_tokens=int(r["output_tokens"]), ignore_eos=True),
                                                arrival=r["arrival_s"])
            nxt += 1
        if now > time_limit_s:
            break
        events = engine.step() if engine.has_work() else []
        ran = engine.take_records()
        steps += ran
        if concurrency:
            for e in events:
                if e.finish_reason and nxt < len(rows):
                    for r in rows[nxt:]:
                        if r["arrival_s"] is None:
                            r["arrival_s"] = engine.now()
                            break
        if ran:
            continue
        upcoming = [t for t in ([rows[nxt]["arrival_s"]] if nxt < len(rows) else []) + [engine.wake_time()]
                    if t is not None]
        if not upcoming:
            break  # nothing will ever arrive or launch again
        wait_until(min(upcoming))
    wall = engine.now()
    return records(workload, reqs), pd.DataFrame([vars(r) for r in steps], columns=STEP_FIELDS), wall


def records(workload: pd.DataFrame, reqs: dict) -> pd.DataFrame:
    """Per-request records: times in seconds on the replay clock; unfinished requests have complete=False."""
    out = []
    for w in workload.itertuples():
        r = reqs.get(w.rid)
        times = list(r.token_times) if r else []
        out.append({"rid": w.rid, "is_long": bool(w.is_long), "prompt_tokens": int(w.prompt_tokens),
                    "output_tokens": int(w.output_tokens), "arrival": r.arrival if r else None,
                    "admit": r.admit_time if r else None, "first_token": times[0] if times else None,
                    "finish": r.finish_time if r else None, "token_times": times, "num_tokens": len(times),
                    "finish_reason": r.finish_reason if r else None, "output": list(r.output) if r else [],
                    "complete": bool(r and r.finish_reason == "length" and len(times) == w.output_tokens)})
    return pd.DataFrame(out)


def tokens_digest(req: pd.DataFrame) -> str:
    """A digest of every request's output tokens (sorted by rid): equal digests, equal tokens."""
    text = ";".join(f"{rid}:{','.join(map(str, out))}" for rid, out in sorted(zip(req["rid"], req["output"])))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def run_one(model, cfg, wl: pd.DataFrame, table: str, name: str, steps_cache: dict[tuple, float]):
    """Replay one run's workload on `model` (the engine at cfg's precision level); returns (summary row, per-request
    records, per-step records). steps_cache: (ref seats, precision level) -> its full-batch step, s."""
    ref, eos = int(cfg.load.ref_seats), eos_ids(model)
    key = (ref, cfg.precision.name)
    if key not in steps_cache:
        steps_cache[key], _ = measured(
            lambda: calibrate_step(model, ref, int(cfg.max_request_tokens), int(wl["prompt_tokens"].median()),
                                   compile=bool(cfg.precision.compile), graphs=bool(cfg.precision.graphs)),
            cfg.measure, f"{table}: the full-batch step at {cfg.precision.name}")
    step_s = steps_cache[key]
    conc = int(cfg.load.concurrency) if cfg.load.process == "closed" else None

    def one():
        engine = build_engine(model, policy_spec(cfg.policy), int(cfg.max_request_tokens), eos_ids=eos,
                           seed=int(cfg.seed), kv=kv_spec(cfg.kv), compile=bool(cfg.precision.compile),
                           graphs=bool(cfg.precision.graphs))
        engine.warm_up()  # compiled steps: compiled now, not in the replay's first steps
        return engine, replay(engine, wl, step_s, conc)

    (engine, (req, st, _)), watch = measured(one, cfg.measure, f"{table} | {name}")
    ttft_lim, tpot_lim = slo_limits(cfg.slo, step_s)
    row = {"table": table, "point": name, "policy": cfg.policy.name, "precision": cfg.precision.name,
           "workload": cfg.workload.name,
           "load": cfg.load.name, "load_multiple": float(cfg.load.get("multiple", float("nan"))),
           "sigma": float(cfg.workload.output.get("sigma", "nan")),  # lognormal tables; shaped: nan
           "length_cv": float(wl["output_tokens"].std(ddof=0) / wl["output_tokens"].mean()), "step_s": step_s,
           "ttft_limit_s": ttft_lim, "tpot_limit_s": tpot_lim, **summarize(req, st, ttft_lim, tpot_lim),
           **watch.fields()}
    if cfg.policy.name in ("static", "dynamic", "bucketed"):
        row["batch_sizes"] = list(engine.scheduler.batch_sizes)
        row["predicted_static_efficiency"] = predicted_static_efficiency(
            wl.sort_values("arrival_steps")["output_tokens"], int(cfg.policy.max_batch))
    for knob in ("max_wait_ms", "token_budget", "max_batch", "max_running"):
        if knob in cfg.policy:
            row[knob] = float(cfg.policy[knob])
    blocks = engine.scheduler.blocks
    row.update({"kv": cfg.kv.name, "concurrency": conc,
                "shared_prefix_tokens": int(cfg.workload.get("shared_prefix_tokens", 0)),
                "tokens_digest": tokens_digest(req)})
    if blocks is not None:
        row.update({"block_size": blocks.block_size, "num_blocks": blocks.num_blocks,
                    "prefix_caching": blocks.prefix_caching})
        if blocks.prefix_caching and conc:  # closed loop: arrival order is the workload's order
            prompts = [list(p) for p in wl.sort_values("arrival_steps", kind="stable")["prompt"]]
            row["expected_cached_tokens"] = expected_prefix_hits(prompts, conc, blocks.block_size)
    print(f"{table} | {name}: {row['throughput_tps']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']:.3f} s, "
          f"{row['complete']}/{row['requests']} complete", flush=True)
    return row, req.assign(point=name), st.assign(point=name)


def save_table(out_dir, table: str, rows: list[dict], reqs: list, steps: list, meta: dict):
    """<table>.json (summary rows + meta), <table>.parquet (requests), <table>_steps.parquet (steps)."""
    write_parquet(out_dir / f"{table}.parquet", pd.concat(reqs, ignore_index=True), meta)
    write_parquet(out_dir / f"{table}_steps.parquet", pd.concat(steps, ignore_index=True), meta)
    write_json(out_dir / f"{table}.json", {"rows": rows, **meta})


def run_table(net_for, base, table: str, workloads: pd.DataFrame) -> tuple[list[dict], list, list]:
    """Every run of a table (pipeline.workloads.runs) replayed on the engine's model at the run's precision level
    (net_for(run config) -> that model): (summary rows, per-request records, per-step records)."""
    steps_cache: dict[tuple, float] = {}
    results = [run_one(net_for(cfg), cfg, workloads[workloads["point"] == name], table, name, steps_cache)
               for name, cfg in runs(base, table)]
    rows, reqs, steps = (list(x) for x in zip(*results))
    return rows, reqs, steps
