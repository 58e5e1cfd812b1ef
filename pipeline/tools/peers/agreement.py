"""python -m pipeline.tools.peers.agreement [overrides] (`make peer` runs it too): the lab's 8-bit levels against
llama.cpp on the same GGUF file at temperature 0 (reports/agreement.json, PEER.md's agreement table). w4a8 reads the
model package's file as stored; w8a8 the file `llama-quantize --allow-requantize <file> <out> Q8_0` writes, whose
blocks are checked equal to those the lab requantizes to at load. Both sides greedy, one request at a time, under
ignore_eos, on the same prompt ids (bench.peer.agreement: how many, how long); llama-server with one slot, its K/V
cache in f32 and flash attention off (the lab's fp32 cache and attention), prompt caching off. Each product's
activations are quantized alike and its integer sums are exact on both sides, so what may still differ is the order
of the fp32 sums (norms, attention, scaling): a difference of one rounding can move an activation across a rounding
boundary of its 8-bit grid, and the tokens apart. The lab's own floor beside it: the same level under another
instruction-set build of its kernels (the integer sums the same, the fp32 sums in another order)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import numpy as np

from engine.children import dies_with_parent
from engine.kernels import BUILD_VAR
from engine.kernels import build as native
from engine.model.gguf import gguf_layers
from engine.model.loader import gguf_path
from pipeline.config import compose_config, load_source, precision_spec
from pipeline.measuring.accuracy import greedy_agreement
from pipeline.measuring.servers import free_port, requests_for, stop
from pipeline.params import load
from pipeline.results import write_json
from pipeline.tools.peers import llama_cpp
from pipeline.tools.peers.inprocess import engine_loop, lab_engine
from pipeline.tools.peers.report import reports_for, rerender
from pipeline.tools.peers.venvs import PEERS, Refused, reason
from pipeline.workloads.prompts import chat_ids

FLOOR = ("import json, sys; from pipeline.config import compose_config; from pipeline.tools.peers.agreement import "
         "lab_tokens; a = json.load(open(sys.argv[1])); json.dump(lab_tokens(compose_config(a['overrides']), "
         "a['level'], a['prompts'], a['tokens']), open(sys.argv[2], 'w'))")  # lab_tokens in a process of its own


def level_file(binary: Path, src: Path, qtype: str | None) -> Path:
    """The GGUF file llama.cpp serves for a level: `src`, or src requantized by llama-quantize to `qtype` (the
    level's own `requantize`; kept beside the build, written aside then renamed)."""
    if qtype is None:
        return src
    out = PEERS / "llama.cpp" / f"{src.stem}.{qtype}.gguf"
    if not out.exists():
        tmp = out.with_suffix(".tmp")
        done = subprocess.run([str(binary.parent / "llama-quantize"), "--allow-requantize", str(src), str(tmp), qtype],
                              capture_output=True, text=True, preexec_fn=dies_with_parent(), check=False)
        if done.returncode:
            raise Refused(f"llama-quantize failed: {reason(done.stdout + done.stderr)}")
        os.replace(tmp, out)
    return out


def same_blocks(a: Path, b: Path, config, requantize: str | None) -> bool:
    """Whether the lab's blocks of file `a` (requantized at load as its level asks) are file `b`'s, byte for byte."""
    mine, theirs = gguf_layers(a, config, requantize=requantize), gguf_layers(b, config)
    flat = [(mine[0]["embed"], theirs[0]["embed"])] + [(m[k], t[k]) for m, t in zip(mine[1], theirs[1]) for k in m]
    return all(np.array_equal(np.concatenate(x[0]) if isinstance(x[0], tuple) else x[0],
                              np.concatenate(y[0]) if isinstance(y[0], tuple) else y[0]) for x, y in flat)


def llama_greedy(binary: Path, gguf: Path, prompts: list[list[int]], tokens: int, threads: int) -> list[list[int]]:
    """llama-server's greedy tokens for each prompt, one at a time (one slot, f32 K/V, flash attention off)."""
    port = free_port()
    args = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-np", "1",
            "-c", str(max(map(len, prompts)) + tokens + 8), "-t", str(threads), "-tb", str(threads), "-ctk", "f32",
            "-ctv", "f32", "-fa", "off", "--no-cache-prompt", "--no-webui"]
    proc = llama_cpp.serve(args, port, PEERS / "llama.cpp" / "agreement.log")
    try:
        out = []
        for p in prompts:
            r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=600, json={
                "prompt": p, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                "return_tokens": True})
            r.raise_for_status()
            out.append(list(r.json()["tokens"]))
        return out
    finally:
        stop(proc)


def lab_tokens(cfg, level: str, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The lab's greedy tokens at `level`, one request at a time, under ignore_eos."""
    eng = lab_engine(cfg, level, 1, max(map(len, prompts)) + tokens)
    return [r["tokens"] for r in engine_loop(eng, prompts, 1, tokens)["records"]]


def floor_build() -> str | None:
    """Another build of the kernels this CPU runs whose fp32 sums go in another order (another vector width): AVX2
    beside an AVX-512 build, scalar beside AVX2; None on a scalar-only CPU."""
    own = (os.environ.get(BUILD_VAR) or native.builds()[0]).split("-")[0]
    return next((b for b in native.builds() if b.split("-")[0] != own and b != "AVX512"), None)


def floor_tokens(cfg, level: str, prompts: list[list[int]], tokens: int, build: str) -> list[list[int]]:
    """lab_tokens under the kernels' build `build` (a process of its own: a process loads one build)."""
    with tempfile.TemporaryDirectory() as tmp:
        args, out = Path(tmp) / "args.json", Path(tmp) / "tokens.json"
        args.write_text(json.dumps({"overrides": [f"model={cfg.model.name}", f"threads={cfg.threads}"],
                                    "level": level, "prompts": prompts, "tokens": tokens}))
        done = subprocess.run([sys.executable, "-c", FLOOR, str(args), str(out)], env={**os.environ, BUILD_VAR: build},
                              capture_output=True, text=True, preexec_fn=dies_with_parent(), check=False)
        if done.returncode:
            raise RuntimeError(f"the {build} build's run failed: {done.stderr[-2000:]}")
        return json.loads(out.read_text())


def divergence(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Equal requests and where the others first diverge (token index)."""
    g = greedy_agreement(ref, got)
    return {"equal": round(g["greedy_exact"] * len(ref)), "first_divergences": g["first_divergences"]}


def run(cfg) -> dict:
    """{"rows": per level, its file and the agreement; "settings"}: bench.peer.agreement's prompts on both sides."""
    a, p = cfg.bench.peer.agreement, cfg.bench.peer
    binary, _ = llama_cpp.build(str(p.llama_cpp.version), flags=llama_cpp.cpu_flags(unit=cfg.isa.unit),
                                level=cfg.isa.name)
    fp32 = compose_config([f"model={cfg.model.name}", "precision=fp32"])
    source, tok = load_source(fp32)
    prompts = [chat_ids(tok, text) for text, _ in requests_for(int(a.prompts), int(a.tokens), cfg.seed)]
    src, rows, build = gguf_path(cfg.model.package, cfg.model.gguf_file), [], floor_build()
    for level in a.levels:
        requantize = precision_spec(level).requantize
        gguf = level_file(binary, src, requantize and requantize.upper())
        theirs = llama_greedy(binary, gguf, prompts, int(a.tokens), int(cfg.threads))
        mine = lab_tokens(cfg, level, prompts, int(a.tokens))
        floor = {"build": build, **divergence(mine, floor_tokens(cfg, level, prompts, int(a.tokens), build))} \
            if build else None
        rows.append({"level": level, "gguf": gguf.name, "blocks_equal": bool(same_blocks(
            src, gguf, source.config, requantize)), "requests": len(prompts), "tokens": int(a.tokens),
            **divergence(theirs, mine), "floor": floor})
    return {"rows": rows, "settings": {"llama.cpp": f"llama-cpp-python {p.llama_cpp.version}'s vendored llama.cpp",
                                       "isa": cfg.isa.name, "command": "llama-server -np 1 -ctk f32 -ctv f32 -fa off "
                                       "--no-cache-prompt; /completion temperature 0, ignore_eos"}}


def main(cfg) -> dict:
    got = run(cfg)
    out = reports_for(cfg.model.name, cfg.isa.name)
    write_json(out / "agreement.json", got)
    rerender(out)
    return got


if __name__ == "__main__":
    main(load())
