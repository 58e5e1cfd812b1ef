"""python -m pipeline.tools.peer [overrides] (`make peer`): the peers of bench.peer.peers (llama_cpp, vllm,
openvino: pipeline/tools/peers/) beside the lab on the same model, machine, concurrencies and requests, back to back
(reports/peer.json, reports/PEER.md). Servers (llama.cpp, vLLM) are loaded with the lab's closed-loop client like
the lab's engine server at each of bench.peer.lab_levels; OpenVINO GenAI runs in-process, like the lab's engine
in-process; with llama_cpp among the peers, the lab's 8-bit levels against llama.cpp on the same GGUF file at
temperature 0 (pipeline/tools/peers/agreement.py); every side's accuracy on the lab's token stream and PEER.md's
accuracy tiers (logprobs.py, tiers.py). A peer that cannot run here gets a row with its own error; the lab's .venv is
checked unchanged. Another model than the configured default (model=...) writes to reports/models/<model>/ beside
its kept reports; a run under another isa level than native (isa=avx2) to isa/<level>/ below, the native one kept."""
import datetime

from omegaconf import OmegaConf

from engine import threads
from pipeline.config import compose_config
from pipeline.measuring.disturbance import server_pids
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.servers import measure, requests_for, start, stop
from pipeline.params import load
from pipeline.results import write_json
from pipeline.tools.peers import agreement, llama_cpp, openvino, vllm
from pipeline.tools.peers.inprocess import LAB, engine_loop, lab_engine
from pipeline.tools.peers.logprobs import Judge
from pipeline.tools.peers.report import reports_for, rerender
from pipeline.tools.peers.tiers import tier_rule
from pipeline.tools.peers.venvs import Refused, freeze
from pipeline.workloads.prompts import chat_ids
from pipeline.workloads.runs import level_not_here

PEERS = {"llama_cpp": llama_cpp.NAME, "vllm": vllm.NAME, "openvino": openvino.NAME}  # bench.peer.peers -> name
SERVER = "lab (engine server)"


def refusal(backend: str, precision: str, mode: str, why) -> dict:
    """A row for what could not run here; why: its own error (or words)."""
    return {"backend": backend, "precision": precision, "mode": mode, "reason": str(why)}


def lab_servers(cfg, names: list[str], load_args: tuple) -> list[dict]:
    """The lab's engine server at each level, continuous batching with bench.peer.slots seats."""
    p, rows = cfg.bench.peer, []
    run = OmegaConf.create({"name": SERVER, "server": "engine", "policy": "continuous", "max_running": int(p.slots)})
    for name in names:
        level = OmegaConf.create(OmegaConf.to_container(cfg))  # the run's config with this level's precision
        level.precision = compose_config([f"model={cfg.model.name}", f"precision={name}"]).precision
        proc, port = start(level, run, int(p.ctx_per_slot))
        try:
            got, _ = measure(f"http://127.0.0.1:{port}/v1", cfg.model.name, SERVER, *load_args, server_pids(proc))
        finally:
            stop(proc)
        rows += [{**r, "precision": name, "mode": "server"} for r in got]
    return rows


def lab_inprocess(cfg, names: list[str], prompts: list[list[int]], load_args: tuple) -> list[dict]:
    """The lab's engine in-process at each level under the closed loop OpenVINO GenAI's driver runs."""
    p, rows = cfg.bench.peer, []
    for name in names:
        eng = lab_engine(cfg, name, int(p.slots), int(p.ctx_per_slot))
        got, _ = openvino.closed_rows(lambda c, n, t: engine_loop(eng, prompts[:n], c, t), LAB, *load_args,
                                      cfg.measure, [])
        rows += [{**r, "precision": name, "mode": "in-process"} for r in got]
    return rows


def server_side(cfg, here: list[str], served: tuple, judge: Judge) -> tuple[list[dict], list[dict], dict]:
    """llama.cpp's and vLLM's rows (those of bench.peer.peers) with their accuracy on the judge's stream, their
    refusals and settings, then the lab's engine server at each level in `here`."""
    p, rows, refused, info = cfg.bench.peer, [], [], {}
    if "llama_cpp" in p.peers:
        try:
            got, info[llama_cpp.NAME] = llama_cpp.run(cfg, served, judge)
            rows += got
        except Refused as exc:
            refused.append(refusal(llama_cpp.NAME, llama_cpp.precision_of(cfg.model.gguf_file), "server", exc))
    if "vllm" in p.peers:
        try:
            got, no, info[vllm.NAME] = vllm.run(cfg, served, judge)
            rows, refused = rows + got, refused + no
        except Refused as exc:
            refused.append(refusal(vllm.NAME, ", ".join(p.vllm.dtypes), "server", exc))
    return rows + lab_servers(cfg, here, served), refused, info


def inprocess_side(cfg, here: list[str], warm: int, judge: Judge) -> tuple[list[dict], list[dict], dict]:
    """OpenVINO GenAI's rows (its greedy reference: the lab's fp32 engine) with their accuracy on the judge's stream,
    its refusals and settings, then the lab's engine in-process at each level in `here`, all on the same chat
    prompts' token ids."""
    p, rows, refused, info = cfg.bench.peer, [], [], {}
    texts = requests_for(max(int(p.n), *p.levels), int(p.max_tokens), cfg.seed)
    prompts = [chat_ids(judge.tokenizer, text) for text, _ in texts]
    load_args = (list(p.levels), int(p.n), int(p.max_tokens), warm)
    try:
        rows, refused, info[openvino.NAME] = openvino.run(cfg, prompts, judge, load_args)
    except Refused as exc:
        refused.append(refusal(openvino.NAME, ", ".join(p.openvino.weights), "in-process", exc))
    return rows + lab_inprocess(cfg, here, prompts, load_args), refused, info


def main(cfg) -> dict:
    p = cfg.bench.peer
    unknown = sorted(set(p.peers) - set(PEERS))
    if unknown:
        raise ValueError(f"bench.peer.peers: unknown {unknown}; choose of {sorted(PEERS)}")
    before = freeze()
    slo = (float("inf"), float("inf"))  # throughput and latency only: no SLO, so goodput is throughput
    warm = int(cfg.bench.server.warm_up_tokens)  # every side warmed up alike at each concurrency
    served = (list(p.levels), int(p.n), int(p.max_tokens), float(p.timeout_s), slo, cfg.seed, warm, cfg.measure)
    names = list(p.lab_levels or [cfg.precision.name])
    why = {n: level_not_here(cfg, n) for n in names}
    here = [n for n in names if not why[n]]
    rows, refused, info = [], [refusal("lab", n, "all", why[n]) for n in names if why[n]], {}
    threads.govern(int(cfg.threads), cfg.measure)  # this process runs the lab's steps
    judge = Judge(cfg)
    floor, lab = judge.floor(), judge.lab(cfg, here)
    for side, wanted in ((server_side, {"llama_cpp", "vllm"}), (inprocess_side, {"openvino"})):
        if wanted & set(p.peers):
            got, no, more = side(cfg, here, served if side is server_side else warm, judge)
            rows, refused, info = rows + got, refused + no, {**info, **more}
    rows = [{**r, "teacher_forced": lab.get(r["precision"])} if r["backend"] in (SERVER, LAB) else r for r in rows]
    changed = sorted(set(before) ^ set(freeze()))
    settings = {**OmegaConf.to_container(p), "model": cfg.model.name, "isa": cfg.isa.name, "unit": cfg.isa.unit,
                "peers": info, "accuracy": {**judge.settings(floor), **tier_rule(cfg)},
                "lab": f"the engine, continuous batching, {p.slots} requests at once, at "
                       + ", ".join(f"`{n}`" for n in here),
                "freeze": f"changed: {changed}" if changed else f"unchanged ({len(before)} packages)"}
    env, out = environment(cfg.threads, cfg.precision.device), reports_for(cfg.model.name, cfg.isa.name)
    settings["date"] = datetime.date.today().isoformat()
    write_json(out / "peer.json", {"rows": rows, "refused": refused, "settings": settings, "machine": env})
    if "llama_cpp" in p.peers and p.agreement.levels:
        try:
            write_json(out / "agreement.json", agreement.run(cfg))
        except Refused as exc:
            write_json(out / "agreement.json", {"rows": [], "refused": str(exc)})
    for folder in dict.fromkeys([out, reports_for(cfg.model.name)]):  # the native run's links this one
        rerender(folder)
    if changed:
        raise SystemExit(f"the lab's .venv changed while the peers ran: {changed}")
    return settings


if __name__ == "__main__":
    main(load())
