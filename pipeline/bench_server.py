"""Stage bench_server: start each server, load it closed-loop at each concurrency, stop it; then the in-process
references for the c=64 continuous level. Writes data/results/server/servers.{json,parquet} and reports/SCOREBOARD.md.

Seed 000's measurements: naive and dynamic (max_batch 16, 50 ms) through Hugging Face generate, the engine with
continuous batching (64 seats), at c = 1, 4, 16, 64 with short prompts and fixed max_tokens under ignore_eos;
mixed lengths at c = 16; pure static (no deadline) at low load (break it).
Open loop: the main table's saved workload (its Poisson or gamma arrivals, converted to seconds with the step time
its engine replay measured) against an engine server running the main policy, beside that in-process replay.
With bench.target.base_url set, the same levels run against that OpenAI-compatible endpoint instead.
"""
import asyncio
import datetime
import json
import os
import random
import socket
import subprocess
import sys
import time

import httpx
import pandas as pd
from omegaconf import OmegaConf

from engine.loader import eos_ids
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json, write_parquet, write_text
from pipeline.loadgen import closed_loop, open_loop
from pipeline.metrics import slo_limits, summarize
from pipeline.prompts import CHAT, chat_ids
from pipeline.tables import fmt
from pipeline.speed import engine_run, hf_generate, warm_compiled

OUT = ROOT / "data" / "results" / "server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cfg, run, port: int, seat_tokens: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "servers", f"model={cfg.model.name}", f"precision={cfg.precision.name}",
            f"server={run.server}", f"port={port}", f"server.seat_tokens={seat_tokens}", "server.max_waiting=4096",
            "server.max_queue_wait_s=inf",  # closed loops measure queueing: admit everyone
            f"threads={cfg.threads}", f"seed={cfg.seed}",
            *([f"policy={run.policy}", f"policy.max_seats={run.seats}"] if run.server == "engine" else []),
            *[f"{'policy' if run.server == 'engine' else 'server'}.{k}={v}" for k, v in (run.get("knobs") or {}).items()]]
    return wait_ready(subprocess.Popen(args, cwd=ROOT, env={**os.environ, "LAB_API_KEY": ""}), port, run.name)


def wait_ready(proc: subprocess.Popen, port: int, name: str, timeout_s: float = 300,
               warm_s: float = 3600) -> subprocess.Popen:
    """proc once its /health on 127.0.0.1:port answers 200; killed and an error if it exits, does not answer within
    timeout_s, or is still warming up (compiling its steps, LLMEngine.warm_up) warm_s after its start."""
    start = time.time()
    deadline = start + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {name} exited with {proc.returncode}")
        try:
            r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            if r.status_code == 200:
                return proc
            if r.json().get("status") == "warming up":
                deadline = max(deadline, start + warm_s)
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server {name} did not come up")


def stop(proc: subprocess.Popen):
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def requests_for(n: int, lengths, seed: int) -> list[tuple]:
    """n (chat text, max_tokens) pairs: prompts cycle through CHAT; lengths an int or a list to draw from."""
    rng = random.Random(seed)
    return [(CHAT[i % len(CHAT)], lengths if isinstance(lengths, int) else rng.choice(list(lengths)))
            for i in range(n)]


def summary(out: list[dict], df: pd.DataFrame, ttft_limit: float, tpot_limit: float, label: str) -> dict:
    """The metrics module's summary of one load run, with its error count and first error; printed."""
    s = summarize(df, None, ttft_limit, tpot_limit)
    errors = [r["error"] for r in out if r["error"]]
    print(f"{label}: {s['throughput_tps']:.1f} tok/s, TTFT p50 {s['ttft_p50_s']:.3f} s, "
          f"{s['complete']}/{s['requests']} complete", flush=True)
    return {**s, "errors": len(errors), "first_error": errors[0] if errors else None}


def http_cpu_s(base_url: str) -> float | None:
    """The lab server's HTTP thread CPU seconds so far (its /metrics); None for a server without that metric."""
    try:
        text = httpx.get(base_url.removesuffix("/v1") + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                 if line.startswith("lab:http_thread_cpu_seconds{")), None)


def measure(base_url, model, name, levels, n, lengths, timeout_s, slo, seed, warm_up_tokens: int, api_key=None):
    """Each level's closed loop, after a warm-up round of its first c requests with warm_up_tokens each (unrecorded;
    0: none): the in-process references are timed after a warm-up too."""
    rows, recs = [], []
    for c in levels:
        reqs = requests_for(max(n, c), lengths, seed)
        if warm_up_tokens:
            asyncio.run(closed_loop(base_url, model, [(p, warm_up_tokens) for p, _ in reqs[:c]], c, timeout_s, api_key,
                                    progress=False))
        cpu0 = http_cpu_s(base_url)
        out = asyncio.run(closed_loop(base_url, model, reqs, c, timeout_s, api_key))
        cpu1 = http_cpu_s(base_url)
        df = pd.DataFrame(out).assign(is_long=False)
        s = summary(out, df, slo[0], slo[1], f"{name} c={c}")
        tokens, tpot = sum(r["num_tokens"] for r in out), s["tpot_p50_s"]
        cpu = (cpu1 - cpu0) * 1e3 / tokens if None not in (cpu0, cpu1) and tokens else None
        rows.append({"backend": name, "concurrency": c, "ttft_limit_s": slo[0], "tpot_limit_s": slo[1], **s,
                     "per_stream_tps": 1 / tpot if tpot == tpot and tpot else None,
                     "http_cpu_ms_per_token": cpu})  # the HTTP thread's CPU per streamed token, ms
        recs.append(df.assign(backend=name, concurrency=c))
    return rows, recs


def open_loop_run(cfg, table: str, timeout_s: float) -> tuple[dict, pd.DataFrame]:
    """The table's workload, open loop, against an engine server with the base policy; and its in-process replay.
    Returns (summary row with the replay's figures beside it, per-request records)."""
    wl = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
    replayed = json.loads((ROOT / "data" / "results" / "engine" / f"{table}.json").read_text())["rows"][0]
    run = OmegaConf.create({"name": f"{cfg.policy.name} (open loop)", "server": "engine", "policy": cfg.policy.name,
                            "seats": cfg.policy.max_seats,
                            "knobs": {k: v for k, v in cfg.policy.items() if k not in ("name", "max_seats")}})
    port = free_port()
    proc = start(cfg, run, port, int(cfg.seat_tokens))
    try:
        reqs = [(list(map(int, p)), int(n)) for p, n in zip(wl["prompt"], wl["output_tokens"])]
        arrivals = (wl["arrival_steps"] * replayed["step_s"]).tolist()
        out = asyncio.run(open_loop(f"http://127.0.0.1:{port}/v1", cfg.model.name, reqs, arrivals, timeout_s))
    finally:
        stop(proc)
    df = pd.DataFrame(out).assign(is_long=wl["is_long"].to_numpy())
    s = summary(out, df, replayed["ttft_limit_s"], replayed["tpot_limit_s"], run.name)
    row = {"backend": run.name, "table": table, "load": f"{cfg.load.name} {cfg.load.get('multiple', '')}x".strip(),
           **s, "replay": {k: replayed[k] for k in ("throughput_tps", "goodput_tps", "ttft_p50_s", "ttft_p99_s",
                                               "tpot_p50_s", "requests", "complete")}}
    return row, df.assign(rid=wl["rid"].to_numpy()).drop(columns=["error"])


def references(cfg, n: int, max_tokens: int) -> dict:
    """The same c=64 requests in-process: the engine (64 seats, its steps compiled as the server's are) and HF
    generate on a padded batch, each after the same warm-up as the server's level."""
    model, tok = load_configured_model(cfg)
    prompts = [chat_ids(tok, text) for text, _ in requests_for(n, max_tokens, 0)]
    eos, compile, graphs = eos_ids(model), bool(cfg.precision.compile), bool(cfg.precision.graphs)
    warm = int(cfg.bench.server.warm_up_tokens)
    if compile:
        warm_compiled(model, len(prompts), eos, graphs)
    if warm:  # the same requests with warm_up_tokens each, as the server's level was warmed
        engine_run(model, prompts, warm, eos, compile, graphs=graphs)
    eng = engine_run(model, prompts, max_tokens, eos, compile, graphs=graphs)
    if warm:
        hf_generate(model, prompts, warm, tok.pad_token_id or 0)
    hf = hf_generate(model, prompts, max_tokens, tok.pad_token_id or 0)
    return {"engine_tps": n * max_tokens / eng["total"], "hf_tps": n * max_tokens / hf}


def scoreboard(rows: list[dict], env: dict, ref: dict | None, opened: dict | None) -> str:
    day = datetime.date.today().isoformat()
    lines = ["# Scoreboard", "",
             f"Closed-loop load, short chat prompts, fixed max_tokens with ignore_eos, each level after an unrecorded "
             f"warm-up round of its c requests (`bench.server.warm_up_tokens` tokens each), on {env['label']} "
             f"(machine `{env['id']}`). Generated by `python -m pipeline.bench_server`; all measured. `hf-*` rows are "
             "Hugging Face `generate` behind the same API; `engine-*` rows are the lab's engine with that policy. "
             "HTTP CPU: the CPU time of the server's event-loop thread (requests, detokenizing, JSON, SSE writes) per "
             "streamed token, from its /metrics (`lab:http_thread_cpu_seconds`).", "",
             "| date | backend | c | ok | TTFT p50, s | TTFT p99, s | tok/s | per-stream tok/s | max gap p99, s | "
             "HTTP CPU, ms/token | errors |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {day} | {r['backend']} | {r['concurrency']} | {r['complete']}/{r['requests']} | "
                     f"{fmt(r['ttft_p50_s'])} | {fmt(r['ttft_p99_s'])} | {fmt(r['throughput_tps'], 1)} | "
                     f"{fmt(r['per_stream_tps'], 1)} | {fmt(r['max_gap_p99_s'])} | "
                     f"{fmt(r.get('http_cpu_ms_per_token'), 3)} | {r['errors']} |")
    if ref:
        lines += ["", f"c=64 continuous server against the same requests in-process (one run): server "
                  f"{ref['server_tps']:.1f} tok/s, engine {ref['engine_tps']:.1f} tok/s (ratio "
                  f"{ref['server_tps'] / ref['engine_tps']:.2f}), HF generate padded batch {ref['hf_tps']:.1f} tok/s "
                  f"(ratio {ref['server_tps'] / ref['hf_tps']:.2f})."]
    if opened:
        lines += ["", f"Open loop: the `{opened['table']}` table's workload ({opened['requests']} requests, "
                  f"{opened['load']} arrivals), through the server and replayed in-process (measured).", "",
                  "| run | ok | TTFT p50, s | TTFT p99, s | TPOT p50, ms | tok/s | goodput, tok/s |", "|---|---|---|---|---|---|---|"]
        for name, r in ((opened["backend"], opened), ("engine in-process replay", opened["replay"])):
            lines.append(f"| {name} | {r['complete']}/{r['requests']} | {fmt(r['ttft_p50_s'])} | "
                         f"{fmt(r['ttft_p99_s'])} | {fmt(r['tpot_p50_s'] * 1e3, 0)} | {fmt(r['throughput_tps'], 1)} | "
                         f"{fmt(r['goodput_tps'], 1)} |")
    return "\n".join(lines) + "\n"


def main(cfg):
    b = cfg.bench.server
    main = ROOT / "data" / "results" / "engine" / "main.json"
    if not main.exists():
        raise SystemExit(f"{main.relative_to(ROOT)} is missing: the SLOs are multiples of the main replay's step; "
                         "run `dvc repro bench_server` (it runs bench_engine@main first)")
    main_step_s = json.loads(main.read_text())["rows"][0]["step_s"]
    slo = slo_limits(cfg.slo, main_step_s)  # relative limits: multiples of the main replay's measured step
    rows, recs, ref, opened, open_recs = [], [], None, None, pd.DataFrame()
    t = cfg.bench.target
    if t.base_url:
        key = os.environ.get(t.api_key_env) if t.api_key_env else None
        r, d = measure(t.base_url, t.model, t.name, b.runs[-1].levels, b.runs[-1].n, b.max_tokens, b.timeout_s, slo,
                       cfg.seed, b.warm_up_tokens, key)
        rows, recs = rows + r, recs + d
    else:
        seat_tokens = 512 + max(b.max_tokens, *b.mixed.max_tokens)
        for run in [*b.runs, {**b.break_static, "name": "hf-static (no deadline)"}]:
            run = type(b)(run) if isinstance(run, dict) else run
            port = free_port()
            proc = start(cfg, run, port, seat_tokens)
            try:
                url = f"http://127.0.0.1:{port}/v1"
                r, d = measure(url, cfg.model.name, run.name, run.levels, run.n, b.max_tokens,
                               run.get("timeout_s", b.timeout_s), slo, cfg.seed,
                               run.get("warm_up_tokens", b.warm_up_tokens))
                if run.get("mixed"):
                    mr, md = measure(url, cfg.model.name, f"{run.name}, mixed lengths", b.mixed.levels, b.mixed.n,
                                     list(b.mixed.max_tokens), b.timeout_s, slo, cfg.seed, b.warm_up_tokens)
                    r, d = r + mr, d + md
            finally:
                stop(proc)
            rows, recs = rows + r, recs + d
        c64 = [r for r in rows if r["backend"] == "engine-continuous" and r["concurrency"] == 64]
        if c64:
            ref = {**references(cfg, c64[0]["requests"], int(b.max_tokens)), "server_tps": c64[0]["throughput_tps"]}
        if b.get("open_loop"):
            opened, open_recs = open_loop_run(cfg, b.open_loop.table, float(b.timeout_s))
    env = environment(cfg.threads, cfg.precision.device)
    meta = {"machine": env, "bench": OmegaConf.to_container(b)}
    write_parquet(OUT / "servers.parquet", pd.concat(recs, ignore_index=True).drop(columns=["error"]), meta)
    write_parquet(OUT / "open_loop.parquet", open_recs, meta)
    write_json(OUT / "servers.json", {"rows": rows, "reference_c64": ref, "open_loop": opened, "machine": env})
    write_text(ROOT / "reports" / "SCOREBOARD.md", scoreboard(rows, env, ref, opened))


if __name__ == "__main__":
    main(load())
