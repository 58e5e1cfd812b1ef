"""The seed tables' workloads and the load generator's Poisson arrivals stay bit-identical for the same seed: their
digests are kept in tests/fixtures/workload_fingerprints.json (rewrite it with
`python -m tests.pipeline.test_workload_compat` only when a change of them is meant)."""
import hashlib
import json
from pathlib import Path

from omegaconf import OmegaConf

from engine.model.loader import load_tokenizer
from pipeline.config import compose_config
from pipeline.measuring.loadgen import open_loop_times
from pipeline.workloads.generate import build

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "workload_fingerprints.json"
WORKLOADS = ["equal", "headline", "long", "long15", "shared_prefix", "short"]
LOADS = ["all", "closed", "gamma", "poisson"]
CASES = [(w, ld, s, "smoke") for w in WORKLOADS for ld in LOADS for s in (0, 1)] + \
        [(w, "poisson", 0, "full") for w in WORKLOADS]
CHAT_CASES = ["headline", "shared_prefix"]  # built with SmolLM2's tokenizer (real chat prompts)
POISSON = [(2.5, 60.0, 0), (40.0, 1.0, 0), (5.0, 30.0, 3)]  # (requests/s, s, seed) of the load generator's overload


def digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()[:16]


def frame_digest(wl) -> str:
    """Every column of every row, floats by repr: equal digests, equal workloads."""
    rows = [[r.rid, bool(r.is_long), [int(t) for t in r.prompt], int(r.prompt_tokens), int(r.output_tokens),
             repr(float(r.arrival_steps))] for r in wl.itertuples()]
    return digest([list(wl.columns), rows])


def fingerprints() -> dict:
    out = {}
    for w, ld, s, prof in CASES:
        out[f"{w} load={ld} seed={s} profile={prof}"] = frame_digest(build(compose_config(
            ["model=tiny-llama", f"workload={w}", f"load={ld}", f"seed={s}", f"profile={prof}"]), None, 512))
    for w in CHAT_CASES:
        cfg = compose_config(["model=tiny-chat", f"workload={w}"])
        tok = load_tokenizer(cfg.model)
        out[f"{w} model=tiny-chat"] = frame_digest(build(cfg, tok, len(tok)))
    for rate, dur, seed in POISSON:
        out[f"loadgen poisson rate={rate} duration={dur} seed={seed}"] = digest(
            [repr(t) for t in open_loop_times(OmegaConf.create({"process": "poisson"}), rate, dur, seed)])
    return out


def test_same_seed_same_workloads_and_arrivals_as_recorded():
    recorded, now = json.loads(FIXTURE.read_text()), fingerprints()
    assert sorted(now) == sorted(recorded)
    assert [k for k in recorded if now[k] != recorded[k]] == []


if __name__ == "__main__":
    FIXTURE.write_text(json.dumps(fingerprints(), indent=1) + "\n")
