"""python -m pipeline.tools.peer [overrides] (`make peer`): llama.cpp's own server beside the lab's continuous engine
server, on the same model, machine, concurrencies and requests, back to back (reports/peer.json, reports/PEER.md).

`llama-server` is built once into data/peers/ from the llama.cpp source vendored in the llama-cpp-python sdist, with
the vector units /proc/cpuinfo lists (not GGML_NATIVE) and AMX off: a process must ask Linux for AMX's tile state,
which llama-server does not. It serves the model package's GGUF file with `bench.peer.slots` slots, continuous
batching, prompt caching off and the lab's threads; the lab's server runs the configured precision level.
"""
import datetime
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
from omegaconf import OmegaConf

from engine.config import ROOT, compose_config
from engine.machine import cpu_units
from engine.model.loader import gguf_path
from pipeline.measuring.disturbance import server_pids
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.servers import dies_with_parent, free_port, measure, running, start, stop, wait_ready
from pipeline.params import load
from pipeline.reporting.tables import accuracy_of, fmt
from pipeline.results import write_json, write_text

PEERS = ROOT / "data" / "peers"
LLAMA = "Q4_1 (llama.cpp)"  # the peer's rows: its precision, in its own arithmetic
CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]  # no web UI download
UNITS = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_AVX512": "avx512f",
         "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
OFF = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]  # the tile state is never requested: kept off


def cpu_flags(have: set[str] | None = None) -> list[str]:
    """llama.cpp's CMake switches for a CPU's vector units (`have`: its /proc/cpuinfo flags; default this one's),
    AMX off."""
    have = cpu_units() if have is None else have
    return [f"-D{opt}={'ON' if unit in have else 'OFF'}" for opt, unit in UNITS.items()] + [f"-D{o}=OFF" for o in OFF]


def build(version: str, peers: Path = PEERS, flags: list[str] | None = None) -> tuple[Path, list[str]]:
    """The llama-server binary built from llama-cpp-python==version's vendored llama.cpp with `flags` (default:
    this CPU's), and the CMake flags it was built with; kept, rebuilt for another version or other flags."""
    flags = [*CMAKE, *(cpu_flags() if flags is None else flags)]
    src = peers / "llama.cpp"
    binary, marker = src / "build" / "bin" / "llama-server", src / "BUILT_FROM"
    wanted = json.dumps({"version": version, "flags": flags})
    if binary.exists() and marker.exists() and marker.read_text().strip() == wanted:
        return binary, flags
    shutil.rmtree(src, ignore_errors=True)
    peers.mkdir(parents=True, exist_ok=True)
    sdist = peers / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={version}", "-d", str(peers)], check=True, preexec_fn=dies_with_parent())
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(src, members, filter="data")
    print(f"building llama-server from llama-cpp-python {version} (minutes)", flush=True)
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), *flags], check=True,
                   preexec_fn=dies_with_parent())
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-server", "-j", str(os.cpu_count())],
                   check=True, preexec_fn=dies_with_parent())
    marker.write_text(wanted + "\n")
    return binary, flags


def serve(binary: Path, gguf: Path, p, threads: int, port: int) -> tuple[subprocess.Popen, list[str]]:
    """llama-server on 127.0.0.1:port, ready and answering one request; and its command line."""
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(p.slots),
            "-c", str(p.slots * p.ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
            "--no-cache-prompt", "--no-webui", "--alias", "peer"]
    proc = wait_ready(running(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port, "llama-server")
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
    if r.status_code != 200 or proc.poll() is not None:
        stop(proc)
        raise RuntimeError(f"llama-server built here does not answer (status {r.status_code}, exit {proc.poll()})")
    return proc, args


def shown(args: list[str], gguf: Path) -> str:
    """The command line as a user would type it: the model within its package, the binary relative to the project,
    the port as <port> (a free one each run)."""
    def one(prev: str | None, a: str) -> str:
        if a == str(gguf):
            return f"<site-packages>/{gguf.parent.name}/{gguf.name}"
        if prev == "--port":
            return "<port>"
        return str(Path(a).relative_to(ROOT)) if a.startswith(str(ROOT)) else a
    return " ".join(one(prev, a) for prev, a in zip([None, *args], args))


def render(rows: list[dict], settings: dict, env: dict, prec: dict | None) -> str:
    lines = ["# Peer: llama.cpp's server beside the lab's", "",
             f"Generated by `python -m pipeline.tools.peer` (`make peer`) on {env['label']} (machine `{env['id']}`), "
             f"{datetime.date.today().isoformat()}; all measured, one run, back to back. Closed loop, short chat "
             f"prompts, {settings['max_tokens']} new tokens each under ignore_eos.", "",
             f"- llama.cpp: `llama-server` built from llama-cpp-python {settings['llama_cpp']}'s vendored source with "
             f"`{' '.join(settings['cmake'])}`; it serves `{settings['gguf']}` (4-bit Q4_1 layers, Q8_0 head) with "
             f"its own arithmetic (8-bit activations); command: `{settings['command']}`",
             f"- lab: the engine server, continuous batching, {settings['seats']} requests at once, at "
             + ", ".join(f"`{name}` ({accuracy_of(prec, name)})" for name in settings["precision"]), "",
             "| backend | precision | c | ok | TTFT p50, s | TTFT p99, s | tok/s | per-stream tok/s | "
             "errors | disturbed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['backend']} | {r['precision']} | {r['concurrency']} | {r['complete']}/{r['requests']} | "
                     f"{fmt(r['ttft_p50_s'])} | {fmt(r['ttft_p99_s'])} | {fmt(r['throughput_tps'], 1)} | "
                     f"{fmt(r['per_stream_tps'], 1)} | {r['errors']} | {'yes' if r.get('disturbed') else 'no'} |")
    lines += ["", "| lab precision | c | lab / llama.cpp throughput |", "|---|---|---|"]
    for name, ratios in settings["ratios"].items():
        lines += [f"| {name} | {c} | {fmt(ratio)} |" for c, ratio in ratios.items()]
    return "\n".join(lines) + "\n"


def main(cfg) -> dict:
    p = cfg.bench.peer
    binary, cmake = build(str(p.llama_cpp))
    gguf = gguf_path(cfg.model.package, cfg.model.gguf_file)
    slo = (float("inf"), float("inf"))  # throughput and latency only: no SLO, so goodput is throughput
    warm = int(cfg.bench.server.warm_up_tokens)  # both servers warmed up alike at each concurrency
    port = free_port()
    proc, command = serve(binary, gguf, p, int(cfg.threads), port)
    try:
        rows, _ = measure(f"http://127.0.0.1:{port}/v1", "peer", "llama.cpp", list(p.levels), int(p.n),
                          int(p.max_tokens), float(p.timeout_s), slo, cfg.seed, warm, cfg.measure, server_pids(proc))
    finally:
        stop(proc)
    rows = [{**r, "precision": LLAMA} for r in rows]
    run = OmegaConf.create({"name": "engine-continuous", "server": "engine", "policy": "continuous",
                            "max_running": int(p.slots)})
    names = list(p.lab_levels or [cfg.precision.name])
    for name in names:
        level = OmegaConf.create(OmegaConf.to_container(cfg))  # the run's config with this level's precision
        level.precision = compose_config([f"model={cfg.model.name}", f"precision={name}"]).precision
        port = free_port()
        proc = start(level, run, port, int(p.ctx_per_slot))
        try:
            lab, _ = measure(f"http://127.0.0.1:{port}/v1", cfg.model.name, run.name, list(p.levels), int(p.n),
                             int(p.max_tokens), float(p.timeout_s), slo, cfg.seed, warm, cfg.measure,
                             server_pids(proc))
        finally:
            stop(proc)
        rows += [{**r, "precision": name} for r in lab]
    by = {(r["precision"], r["concurrency"]): r["throughput_tps"] for r in rows}
    settings = {**OmegaConf.to_container(p), "command": shown(command, gguf), "cmake": cmake, "gguf": gguf.name,
                "seats": int(p.slots), "precision": names,
                "ratios": {name: {c: by[(name, c)] / by[(LLAMA, c)] for c in p.levels} for name in names}}
    env = environment(cfg.threads, cfg.precision.device)
    prec_path = ROOT / "reports" / "precision.json"
    prec = json.loads(prec_path.read_text()) if prec_path.exists() else None
    write_json(ROOT / "reports" / "peer.json", {"rows": rows, "settings": settings, "machine": env})
    write_text(ROOT / "reports" / "PEER.md", render(rows, settings, env, prec))
    return settings


if __name__ == "__main__":
    main(load())
