"""The servers under load: each started as its own process (python -m servers) on a free port, one that dies with
its parent (running), loaded closed-loop at each concurrency after a warm-up round, stopped; the main workload open
loop; the in-process references."""
import asyncio
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

from engine.children import running
from engine.model.loader import pad_id
from pipeline.config import ROOT, build_net, load_source
from pipeline.measuring.disturbance import measured, server_pids
from pipeline.measuring.loadgen import closed_loop, open_loop
from pipeline.measuring.metrics import slo_limits, summarize
from pipeline.measuring.timing import engine_run, hf_generate, warm_compiled
from pipeline.workloads.prompts import CHAT, chat_ids
from pipeline.workloads.runs import level_not_here


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unkeyed() -> dict:
    """This process's environment without LAB_API_KEY: a server a bench starts asks for no key."""
    return {**os.environ, "LAB_API_KEY": ""}


def server_args(cfg, run, max_request_tokens: int) -> list[str]:
    """The conf/ overrides of a run's server: an engine server at the run's `precision` (default: cfg's)."""
    level = (run.get("precision") or cfg.precision.name) if run.server == "engine" else cfg.precision.name
    return [f"model={cfg.model.name}", f"precision={level}", f"isa={cfg.isa.name}", f"server={run.server}",
            f"server.max_request_tokens={max_request_tokens}", "server.max_waiting=4096",
            "server.max_queue_wait_s=inf",  # closed loops measure queueing: admit everyone
            f"threads={cfg.threads}", f"seed={cfg.seed}",
            *([f"policy={run.policy}", f"policy.max_running={run.max_running}"] if run.server == "engine" else []),
            *[f"{'policy' if run.server == 'engine' else 'server'}.{k}={v}"
              for k, v in (run.get("knobs") or {}).items()]]


def start(cfg, run, max_request_tokens: int) -> tuple[subprocess.Popen, int]:
    """The run's server on a free port, once it answers, and the port."""
    (proc,), (port,) = serve_all([server_args(cfg, run, max_request_tokens)], [run.name], unkeyed())
    return proc, port


def serve(overrides: list[str], name: str) -> tuple[subprocess.Popen, int]:
    """A lab server (python -m servers with these conf/ overrides) on a free port, once it answers; and the port."""
    (proc,), (port,) = serve_all([overrides], [name])
    return proc, port


def serve_all(overrides: list[list[str]], names: list[str], env: dict | None = None) -> tuple[list, list[int]]:
    """Lab servers (python -m servers with each list of conf/ overrides), each on a free port, started together;
    once every one answers: (processes, ports). One that fails to come up: all of them killed, the error raised."""
    ports = [free_port() for _ in overrides]
    procs = [running([sys.executable, "-m", "servers", *o, f"port={p}"], cwd=ROOT, env=env)
             for o, p in zip(overrides, ports)]
    try:
        for proc, port, name in zip(procs, ports, names):
            wait_ready(proc, port, name)
    except RuntimeError:
        for proc in procs:
            proc.kill()
        raise
    return procs, ports


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


def stop(*procs: subprocess.Popen):
    """SIGTERM each (a lab server drains), then reaped: killed if still there after 20 s."""
    for proc in procs:
        proc.terminate()
    reap(list(procs))


def reap(procs: list[subprocess.Popen]):
    """Wait for stopped processes to end, killing any still there after 20 s."""
    for proc in procs:
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


def measure(base_url, model, name, levels, n, lengths, timeout_s, slo, seed, warm_up_tokens: int, limits, pids=(),
            api_key=None):
    """A closed loop at each concurrency c in `levels`, after an unrecorded warm-up round of its first c requests
    with warm_up_tokens each (0: none), measured again while disturbed (limits: the config's `measure`; pids: the
    server's processes, whose CPU is the run's own). Returns (summary rows, per-request records)."""
    rows, recs = [], []
    for c in levels:
        reqs = requests_for(max(n, c), lengths, seed)
        if warm_up_tokens:
            asyncio.run(closed_loop(base_url, model, [(p, warm_up_tokens) for p, _ in reqs[:c]], c, timeout_s, api_key,
                                    progress=False))

        def level():
            cpu0 = http_cpu_s(base_url)
            out = asyncio.run(closed_loop(base_url, model, reqs, c, timeout_s, api_key))
            return out, cpu0, http_cpu_s(base_url)

        (out, cpu0, cpu1), watch = measured(level, limits, f"{name} c={c}", pids)
        df = pd.DataFrame(out).assign(is_long=False)
        s = summary(out, df, slo[0], slo[1], f"{name} c={c}")
        tokens, tpot = sum(r["num_tokens"] for r in out), s["tpot_p50_s"]
        cpu = (cpu1 - cpu0) * 1e3 / tokens if None not in (cpu0, cpu1) and tokens else None
        rows.append({"backend": name, "concurrency": c, "ttft_limit_s": slo[0], "tpot_limit_s": slo[1], **s,
                     "per_stream_tps": 1 / tpot if tpot == tpot and tpot else None,
                     "http_cpu_ms_per_token": cpu, **watch.fields()})  # the HTTP thread's CPU per streamed token, ms
        recs.append(df.assign(backend=name, concurrency=c))
    return rows, recs


def open_loop_run(cfg, table: str, timeout_s: float) -> tuple[dict, pd.DataFrame]:
    """The table's workload, open loop, against an engine server with the base policy; and its in-process replay.
    Returns (summary row with the replay's figures beside it, per-request records)."""
    wl = pd.read_parquet(ROOT / "data" / "workloads" / f"{table}.parquet")
    replayed = json.loads((ROOT / "data" / "results" / "engine" / f"{table}.json").read_text())["rows"][0]
    run = OmegaConf.create({"name": f"{cfg.policy.name} (open loop)", "server": "engine", "policy": cfg.policy.name,
                            "max_running": cfg.policy.max_running,
                            "knobs": {k: v for k, v in cfg.policy.items() if k not in ("name", "max_running")}})
    proc, port = start(cfg, run, int(cfg.max_request_tokens))
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


def references(cfg, n: int, max_tokens: int, concurrency: int) -> dict:
    """A level's n requests in-process: the engine with `concurrency` running at once, as the server had them (its
    steps compiled as the server's are), and HF generate on one padded batch of all n, each first warmed up with
    warm_up_tokens per request."""
    source, tok = load_source(cfg)
    prompts = [chat_ids(tok, text) for text, _ in requests_for(n, max_tokens, 0)]
    net, compile, graphs = (build_net(source, cfg), bool(cfg.precision.compile),
                            bool(cfg.precision.graphs))
    model = source if cfg.precision.get("reference_dtype", cfg.precision.dtype) == cfg.precision.dtype \
        else load_source(cfg, reference=True)[0]
    warm = int(cfg.bench.server.warm_up_tokens)
    if compile:
        warm_compiled(net, concurrency, graphs)
    if warm:  # every request with warm_up_tokens, as a server's warm-up round before each concurrency
        engine_run(net, prompts, warm, compile, graphs=graphs, max_running=concurrency)
    eng = engine_run(net, prompts, max_tokens, compile, graphs=graphs, max_running=concurrency)
    if warm:
        hf_generate(model, prompts, warm, pad_id(tok))
    hf, _ = hf_generate(model, prompts, max_tokens, pad_id(tok))
    return {"engine_tps": n * max_tokens / eng["total"], "hf_tps": n * max_tokens / hf}


def main_step_s(root=ROOT) -> float:
    """The main replay's measured full-batch decode step (s): the unit of the relative SLOs."""
    main = root / "data" / "results" / "engine" / "main.json"
    if not main.exists():
        raise SystemExit(f"{main.relative_to(root)} is missing: the SLOs are multiples of the main replay's step; "
                         "run `dvc repro bench_server` (it runs bench_engine first)")
    return json.loads(main.read_text())["rows"][0]["step_s"]


def run_servers(cfg) -> tuple[list[dict], list[pd.DataFrame], dict | None, dict | None, pd.DataFrame]:
    """bench.server's runs and its break_static run (or only bench.target's endpoint): (summary rows, per-request
    records, the c=64 in-process references, the open-loop row, its per-request records)."""
    b = cfg.bench.server
    slo = slo_limits(cfg.slo, main_step_s())
    rows, recs, ref, opened, open_recs = [], [], None, None, pd.DataFrame()
    t = cfg.bench.target
    if t.base_url:
        key = os.environ.get(t.api_key_env) if t.api_key_env else None
        r, d = measure(t.base_url, t.model, t.name, b.runs[-1].levels, b.runs[-1].n, b.max_tokens, b.timeout_s, slo,
                       cfg.seed, b.warm_up_tokens, cfg.measure, api_key=key)
        return r, d, ref, opened, open_recs
    max_request_tokens = 512 + max(b.max_tokens, *b.mixed.max_tokens)
    here = []
    for run in [*b.runs, {**b.break_static, "name": "hf-static (no deadline)"}]:
        run = OmegaConf.create(run) if isinstance(run, dict) else run
        why = level_not_here(cfg, run.precision) if run.get("precision") else None
        if why:
            print(f"{run.name}: not run here: {why}", flush=True)
        else:
            here.append(run)
    # every server started together (their start-up is mostly one thread's imports); each waits idle on its queue
    # until its turn, and is stopped before the next one is measured
    procs, ports = serve_all([server_args(cfg, run, max_request_tokens) for run in here], [r.name for r in here],
                             unkeyed())
    try:
        for run, proc, port in zip(here, procs, ports):
            try:
                url = f"http://127.0.0.1:{port}/v1"
                r, d = measure(url, cfg.model.name, run.name, run.levels, run.n, b.max_tokens,
                               run.get("timeout_s", b.timeout_s), slo, cfg.seed,
                               run.get("warm_up_tokens", b.warm_up_tokens),
                               cfg.measure, server_pids(proc))
                if run.get("mixed"):
                    mr, md = measure(url, cfg.model.name, f"{run.name}, mixed lengths", b.mixed.levels, b.mixed.n,
                                     list(b.mixed.max_tokens), b.timeout_s, slo, cfg.seed, b.warm_up_tokens,
                                     cfg.measure, server_pids(proc))
                    r, d = r + mr, d + md
            finally:
                stop(proc)
            level = (run.get("precision") or cfg.precision.name) if run.server == "engine" else \
                {"float32": "fp32"}.get(cfg.precision.dtype, cfg.precision.dtype)
            rows, recs = rows + [{**row, "precision": level} for row in r], recs + d
    finally:
        stop(*[p for p in procs if p.poll() is None])
    c64 = [r for r in rows if r["backend"] == "engine-continuous" and r["concurrency"] == 64]
    if c64:
        ref = {**references(cfg, c64[0]["requests"], int(b.max_tokens), 64), "server_tps": c64[0]["throughput_tps"]}
    if b.get("open_loop"):
        opened, open_recs = open_loop_run(cfg, b.open_loop.table, float(b.timeout_s))
    return rows, recs, ref, opened, open_recs
