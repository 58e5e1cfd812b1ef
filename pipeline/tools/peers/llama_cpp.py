"""llama.cpp's own server: `llama-server` built once into data/peers/llama.cpp/ from the llama.cpp source vendored in
the llama-cpp-python sdist, with the vector units of the run's isa level (native: those /proc/cpuinfo lists, not
GGML_NATIVE; avx2: AVX2, FMA and F16C only, whatever wider units the CPU has), each level in a build folder of its own,
AMX off (a process must ask Linux for AMX's tile state, which llama-server does not). It serves the model package's
GGUF file with `slots` slots, continuous batching, prompt caching off and the lab's threads."""
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from functools import partial
from pathlib import Path

import httpx

from engine.children import dies_with_parent, running
from engine.hardware import cpu_units
from engine.model.loader import gguf_path
from pipeline.measuring.disturbance import server_pids
from pipeline.measuring.servers import free_port, measure, stop, wait_ready
from pipeline.tools.peers.logprobs import llama_tops
from pipeline.tools.peers.report import shown
from pipeline.tools.peers.venvs import PEERS, Refused, logger, reason

NAME = "llama.cpp"


def precision_of(gguf_file: str) -> str:
    """The peer's rows' precision: the GGUF file's quantization type (its name's last field), in llama.cpp's own
    arithmetic, e.g. "Q4_1 (llama.cpp)" for SmolLM2-135M-Instruct.Q4_1.gguf, "Q4_K_M (llama.cpp)" for Gemma 3's."""
    found = re.search(r"[._-]((?:i?q|f|bf)\d[\w]*)\.gguf$", gguf_file, re.IGNORECASE)
    return f"{found.group(1).upper() if found else gguf_file} (llama.cpp)"
CMAKE = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
         "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]  # no web UI download
UNITS = {"GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c", "GGML_AVX512": "avx512f",
         "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}
OFF = ["GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"]  # the tile state is never requested: kept off
LEVEL_UNITS = {"AVX2": {"avx", "avx2", "fma", "f16c"}, "no AVX2": set()}  # conf/isa `unit` -> the units it allows


def cpu_flags(have: set[str] | None = None, unit: str | None = None) -> list[str]:
    """llama.cpp's CMake switches for a CPU's vector units (`have`: its /proc/cpuinfo flags; default this one's)
    held to an isa level's `unit` (None: all it has), AMX off."""
    have = cpu_units() if have is None else have
    if unit is not None:
        have = have & LEVEL_UNITS[unit]
    return [f"-D{opt}={'ON' if u in have else 'OFF'}" for opt, u in UNITS.items()] + [f"-D{o}=OFF" for o in OFF]


def source(version: str, peers: Path) -> Path:
    """llama-cpp-python==version's vendored llama.cpp, extracted once into peers/llama.cpp (again for another
    version, its builds removed with it)."""
    src, marker = peers / "llama.cpp", peers / "llama.cpp" / "SOURCE"
    if marker.exists() and marker.read_text().strip() == version:
        return src
    shutil.rmtree(src, ignore_errors=True)
    peers.mkdir(parents=True, exist_ok=True)
    sdist = peers / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python",
                              f"llama-cpp-python=={version}", "-d", str(peers)], capture_output=True, text=True,
                             preexec_fn=dies_with_parent(), check=False)
        if got.returncode:
            raise Refused(f"its source could not be fetched: {reason(got.stdout + got.stderr)}")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
        for m in members:
            m.name = m.name[len(prefix):]
        tar.extractall(src, members, filter="data")
    marker.write_text(version + "\n")
    return src


def build(version: str, peers: Path = PEERS, flags: list[str] | None = None,
          level: str = "native") -> tuple[Path, list[str]]:
    """The llama-server binary built from llama-cpp-python==version's vendored llama.cpp with `flags` (default:
    this CPU's) in the isa level's own folder, and the CMake flags it was built with; kept, rebuilt for other
    flags (another level's build untouched)."""
    flags = [*CMAKE, *(cpu_flags() if flags is None else flags)]
    out = peers / "llama.cpp" / f"build-{level}"
    binary, marker = out / "bin" / "llama-server", out / "BUILT_FROM"
    wanted = json.dumps({"version": version, "flags": flags})
    if binary.exists() and marker.exists() and marker.read_text().strip() == wanted \
            and (peers / "llama.cpp" / "SOURCE").read_text().strip() == version:
        why = runs(binary)
        if why is None:
            return binary, flags
        logger.warning("llama-server (%s) %s: building it again", level, why)
    src = source(version, peers)
    shutil.rmtree(out, ignore_errors=True)
    print(f"building llama-server ({level}) from llama-cpp-python {version} (minutes)", flush=True)
    log = peers / "llama.cpp" / f"build-{level}.log"
    with log.open("w") as f:
        for cmd in (["cmake", "-S", str(src), "-B", str(out), *flags],
                    ["cmake", "--build", str(out), "--target", "llama-server", "-j", str(os.cpu_count())]):
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, preexec_fn=dies_with_parent(),
                              check=False).returncode:
                raise Refused(f"`{' '.join(cmd[:2])}` failed: {reason(log.read_text())}")
    marker.write_text(wanted + "\n")
    return binary, flags


def runs(binary: Path) -> str | None:
    """Why the built binary does not run (`llama-server --version` fails: cut short, damaged), or None."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run ({exc})"
    return None if out.returncode == 0 else f"does not run (exit {out.returncode}: {reason(out.stderr + out.stdout)})"


def command(binary: Path, gguf: Path, p, threads: int, port: int) -> list[str]:
    """llama-server's command line: `p.slots` slots of p.ctx_per_slot tokens, continuous batching, no prompt cache."""
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", str(p.slots),
            "-c", str(p.slots * p.ctx_per_slot), "-t", str(threads), "-tb", str(threads), "--cont-batching",
            "--no-cache-prompt", "--no-webui", "--alias", "peer"]


def serve(args: list[str], port: int, log: Path) -> subprocess.Popen:
    """llama-server on 127.0.0.1:port (its output in `log`), ready and answering one request."""
    with log.open("w") as out:
        proc = running(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, NAME)
    except RuntimeError as exc:
        raise Refused(f"{exc}: {reason(log.read_text())}") from exc
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=120)
    if r.status_code != 200 or proc.poll() is not None:
        stop(proc)
        raise Refused(f"llama-server built here does not answer (status {r.status_code}, exit {proc.poll()}): "
                      f"{reason(log.read_text())}")
    return proc


def run(cfg, load, judge) -> tuple[list[dict], dict]:
    """llama.cpp's rows at bench.peer's concurrencies (load: the lab's closed-loop arguments), with its accuracy on
    the stream of `judge` (logprobs.Judge), and its settings."""
    p, level = cfg.bench.peer, cfg.isa
    binary, cmake = build(str(p.llama_cpp.version), flags=cpu_flags(unit=level.unit), level=level.name)
    gguf = gguf_path(cfg.model.package, cfg.model.gguf_file)
    port = free_port()
    args = command(binary, gguf, p, int(cfg.threads), port)
    proc = serve(args, port, PEERS / "llama.cpp" / f"serve-{level.name}.log")
    try:
        rows, _ = measure(f"http://127.0.0.1:{port}/v1", "peer", NAME, *load, server_pids(proc))
        tf = judge.fetched(partial(llama_tops, f"http://127.0.0.1:{port}"),
                            "its server's n_probs after each prefix")
    finally:
        stop(proc)
    alias = {str(gguf): f"<site-packages>/{gguf.parent.name}/{gguf.name}"}
    return [{**r, "precision": precision_of(cfg.model.gguf_file), "mode": "server", "teacher_forced": tf}
            for r in rows], {
        "version": f"llama-cpp-python {p.llama_cpp.version}'s vendored llama.cpp", "cmake": cmake,
        "isa": level.name, "command": shown(args, alias), "gguf": gguf.name}
