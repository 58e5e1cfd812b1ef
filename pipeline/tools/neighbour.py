"""python -m pipeline.tools.neighbour [overrides]: what a busy neighbour costs the engine on this machine. The
engine's decode rate at B=1 and B=64 quiet, beside one busy process (a normal-priority spin loop this script
starts), and quiet again; quiet and beside the neighbour both with the thread governor (engine/threads.py) and with
the threads fixed, so what the governor gains and costs is measured too. Writes reports/neighbour.json."""
import subprocess
import sys
import time

import torch

from engine import threads
from engine.children import running
from pipeline.config import ROOT, build_net, load_source
from pipeline.measuring.disturbance import Watch
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.timing import engine_run
from pipeline.params import load
from pipeline.results import write_json
from pipeline.workloads.prompts import prompts_for

BATCHES = (1, 64)
NEW_TOKENS = 32


def decode_tps(net, prompts, repeats: int = 3) -> float:
    """Best decode rate (tok/s) of `repeats` engine runs of these prompts."""
    best = 0.0
    for _ in range(repeats):
        r = engine_run(net, prompts, NEW_TOKENS)
        best = max(best, len(prompts) * (NEW_TOKENS - 1) / (r["total"] - r["prefill"]))
    return best


def spin() -> subprocess.Popen:
    """One busy process at normal priority: a Python loop that never sleeps (it dies with this one)."""
    return running([sys.executable, "-c", "while True: pass"])


def main(cfg) -> dict:
    model, tok = load_source(cfg)
    net = build_net(model, cfg)
    prompts = {b: prompts_for("chat", b, tok, model.config.vocab_size) for b in BATCHES}
    engine_run(net, prompts[1], 8)  # warm-up
    rows = []
    for label, busy, governed in (("quiet", False, True), ("quiet, fixed threads", False, False),
                                  ("busy, governed", True, True), ("busy, fixed threads", True, False),
                                  ("quiet again", False, True)):
        proc = spin() if busy else None
        time.sleep(1.0 if busy else 0.0)  # the neighbour settles on a core
        threads.govern(int(cfg.threads), cfg.measure) if governed else threads.stop(int(cfg.threads))
        try:
            for b in BATCHES:
                with Watch(cfg.measure) as w:
                    tps = decode_tps(net, prompts[b])
                rows.append({"case": label, "batch": b, "decode_tps": tps, "threads_at_end": torch.get_num_threads(),
                             **w.result.fields()})
                print(rows[-1], flush=True)
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
    quiet = {r["batch"]: r["decode_tps"] for r in rows if r["case"] == "quiet"}
    for r in rows:
        r["slowdown"] = quiet[r["batch"]] / r["decode_tps"]
    out = {"machine": environment(cfg.threads, cfg.precision.device), "rows": rows}
    write_json(ROOT / "reports" / "neighbour.json", out)
    return out


if __name__ == "__main__":
    main(load())
