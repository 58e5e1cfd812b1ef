"""OpenVINO GenAI in its own venv: the prepared model folder exported once per weight format with `optimum-cli export
openvino` (fp32, and int8 / int4 weight compression at optimum-intel's defaults, int4 in groups of `group_size`
weights), each run in-process by openvino_driver.py through its ContinuousBatchingPipeline (prefix caching off, its
chunked prefill, dynamic_split_fuse, as shipped), activations in `hint` precision; its accuracy: greedy agreement
with the lab's fp32 engine on the same prompts, and its exported model's top-k on the lab's stream through
optimum-intel (logprobs.py; estimated, the pipeline returning none). Being in-process, it is set beside the lab's
engine in-process (inprocess.engine_loop), not its server. It runs without an isa level's limits: its CPU plugin
picks its kernels by the CPU, and its compressed products cannot run under oneDNN held to AVX2 on a wider CPU; under
another level than native its rows use every unit the CPU has (a comparison that favours it)."""
import json
import shutil
import subprocess
from pathlib import Path

import torch

from engine.children import running
from engine.kernels import ISA_LIMITS
from engine.model.integrity import folder_damage, write_manifest
from pipeline.measuring.accuracy import greedy
from pipeline.measuring.disturbance import measured
from pipeline.tools.peers.inprocess import agreement, summary
from pipeline.tools.peers.venvs import PEERS, Refused, ensure, logger, reason, run_env, version
from pipeline.tools.peers.vllm import model_dir

NAME = "OpenVINO GenAI"
DRIVER = Path(__file__).with_name("openvino_driver.py")


def export_command(py: Path, model: Path, weights: str, out: Path, group_size: int) -> list[str]:
    """optimum-cli's export of the model folder to OpenVINO IR with `weights` (fp32, int8, int4: `group_size`
    weights per scale)."""
    group = ["--group-size", str(group_size)] if weights == "int4" else []
    return [str(py.parent / "optimum-cli"), "export", "openvino", "--model", str(model), "--task",
            "text-generation-with-past", "--weight-format", weights, *group, str(out)]


def export(py: Path, model: Path, weights: str, group_size: int, env: dict, peers: Path = PEERS) -> Path:
    """The model exported once at `weights` into data/peers/openvino/models/<weights> (again for another source or
    command); a Refused with optimum-cli's own error."""
    out = peers / "openvino" / "models" / weights
    cmd = export_command(py, model, weights, out, group_size)
    marker, wanted = out / "EXPORTED_FROM", json.dumps(cmd)
    if marker.exists() and marker.read_text().strip() == wanted:
        why = folder_damage(out)
        if why is None:
            return out
        logger.warning("%s's %s export %s: exporting it again", NAME, weights, why)
    shutil.rmtree(out, ignore_errors=True)  # no earlier export's files under a new marker
    log = peers / "openvino" / f"export-{weights}.log"
    print(f"{NAME}: exporting {model.name} at {weights} (minutes)", flush=True)
    with log.open("w") as f:
        failed = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if failed:
        raise Refused(f"optimum-cli export at {weights} failed: {reason(log.read_text())}")
    marker.write_text(wanted + "\n")
    write_manifest(out)  # each file's size and sha256, checked before the next use
    return out


class Driver:
    """openvino_driver.py on one exported model, loaded and answering closed-loop runs over stdin and stdout; run
    isolated (-I), so that this folder's openvino.py does not stand in for the openvino package."""

    def __init__(self, py: Path, spec: dict, env: dict, log: Path):
        self.log, spec_path = log, log.with_suffix(".json")
        spec_path.write_text(json.dumps(spec))
        self.err = log.open("w")
        self.proc = running([str(py), "-I", str(DRIVER), str(spec_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=self.err, env=env, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            self.close()
            raise Refused(f"its pipeline did not load: {reason(log.read_text())}")

    def loop(self, c: int, n: int, tokens: int) -> dict:
        """The first n prompts, c in flight, `tokens` new tokens each: the driver's records and wall."""
        self.proc.stdin.write(f"run {c} {n} {tokens}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise Refused(f"the driver ended: {reason(self.log.read_text())}")
        return json.loads(line)

    def tops(self, seqs: list[list[int]], k: int) -> list:
        """The exported model's top-k at every position of the stream the spec holds (seqs: that stream)."""
        self.proc.stdin.write(f"tops {k}\n")
        self.proc.stdin.flush()
        got = json.loads(self.proc.stdout.readline() or '{"error": "the driver ended"}')
        if "error" in got:
            raise ValueError(got["error"])
        return [(torch.tensor(t["ids"]), torch.tensor(t["logprobs"], dtype=torch.float64)) for t in got["tops"]]

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.err.close()


def closed_rows(loop, name: str, levels: list[int], n: int, max_tokens: int, warm: int, limits,
                pids) -> tuple[list[dict], list[list[int]]]:
    """loop(c, n, tokens)'s summary rows at each concurrency (warmed up with c requests of `warm` tokens, measured
    again while disturbed) and the first level's output tokens."""
    rows, outputs = [], None
    for c in levels:
        if warm:
            loop(c, c, warm)
        got, watch = measured(lambda: loop(c, max(n, c), max_tokens), limits, f"{name} c={c}", pids)
        rows.append({"backend": name, "concurrency": c, **watch.fields(),
                     **summary(got.get("records", []), got.get("wall", 0.0), max_tokens, got.get("error"))})
        outputs = outputs or [r["tokens"] for r in got.get("records", []) if r]
    return rows, outputs


def run(cfg, prompts: list[list[int]], judge, load) -> tuple[list[dict], list[dict], dict]:
    """OpenVINO GenAI's rows at each weight format (prompts: the lab's token ids, at least n and the top level;
    judge: logprobs.Judge, whose fp32 net gives the greedy reference; load: (levels, n, max_tokens, warm-up tokens)),
    each with its accuracy on the judge's stream, a refused row per format that did not run, and its settings."""
    p, o = cfg.bench.peer, cfg.bench.peer.openvino
    levels, n, max_tokens, warm = load
    py = ensure("openvino", list(o.packages), list(o.remove))
    env = {k: v for k, v in run_env(int(cfg.threads)).items() if k not in ISA_LIMITS}  # its own units: see above
    model = model_dir(cfg)
    ref = greedy(judge.ref, prompts[:n], max_tokens)
    rows, refused = [], []
    for weights in o.weights:
        try:
            folder = export(py, model, weights, int(o.group_size), env)
            spec = {"model": str(folder), "prompts": prompts, "slots": int(p.slots), "threads": int(cfg.threads),
                    "cache_gb": int(o.cache_gb), "hint": str(o.hint), "stream": judge.seqs}
            driver = Driver(py, spec, env, PEERS / "openvino" / f"driver-{weights}.log")
            try:
                got, outputs = closed_rows(driver.loop, NAME, levels, n, max_tokens, warm, cfg.measure,
                                           [driver.proc.pid])
                tf = {**judge.fetched(driver.tops, "its IR's logits through optimum-intel"), "estimated": True}
            finally:
                driver.close()
        except Refused as exc:
            refused.append({"backend": NAME, "precision": weights, "mode": "in-process", "reason": str(exc)})
            continue
        accuracy = agreement(ref, outputs[:n]) if len(outputs) >= n else "not measured: its run failed"
        units = {} if cfg.isa.name == "native" else {"units": f"on every unit this CPU has, not {cfg.isa.unit}"}
        rows += [{**r, "precision": weights, "mode": "in-process", "accuracy": accuracy, "teacher_forced": tf,
                  **units} for r in got]
    shown = ["optimum-cli", *export_command(py, Path(cfg.model.path), "<weights>", Path("<out>"), 0)[1:]]
    return rows, refused, {"version": f"openvino-genai {version(py, 'openvino-genai')}, optimum-intel "
                                      f"{version(py, 'optimum-intel')}, openvino {version(py, 'openvino')}",
                           "export": " ".join(shown) + f" (int4: --group-size {o.group_size})",
                           "scheduler": f"max_num_seqs {p.slots}, cache_size {o.cache_gb} GB, prefix caching off, "
                                        "dynamic_split_fuse (chunked prefill) as shipped",
                           "properties": f"INFERENCE_NUM_THREADS {cfg.threads}, INFERENCE_PRECISION_HINT {o.hint}",
                           **({} if cfg.isa.name == "native" else {"instruction set": (
                               f"every unit this CPU has, not isa={cfg.isa.name}'s: its CPU plugin picks its kernels "
                               "by the CPU, and its compressed products cannot run under oneDNN held to "
                               f"{cfg.isa.unit} (a comparison that favours it)")})}
