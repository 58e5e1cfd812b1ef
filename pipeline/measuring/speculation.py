"""Speculative decoding against batching, measured: B requests arriving at once on the continuous policy, greedy,
each to its own end (the model's own continuation, at most max_new_tokens), with prompt lookup at each k (0: none;
"adaptive": each step's k in [0, the largest k] from the fitted cost model). Greedy outputs are the same at every k
(the engine is exact; each cell records whether its tokens are k = 0's), so each cell of a batch does the same work.

Each measured cell is simulated beside it: the same scheduler on the virtual clock, the fitted cost model's step
times, drafts proposed on the cell's measured share of the rows asked, at its measured mean length, and kept at its
measured acceptance (an adaptive cell takes the rates of the largest fixed k at its batch, the drafts it would have
been offered).
"""
import numpy as np

from engine import SamplingParams
from engine.core.simulator import RateDrafter, SimRunner, VirtualClock
from engine.core.speculation import NgramDrafter, Speculation
from engine.factory import build_engine
from engine.specs import PolicySpec
from pipeline.measuring.metrics import pct
from pipeline.workloads.passages import copy_prompts
from pipeline.workloads.prompts import short_prompts

WORKLOADS = {"copy": copy_prompts, "chat": lambda n, tok: short_prompts(n, tok)}
ADAPTIVE = "adaptive"


def run_cell(model, prompts, k, k_max: int, drafter, cost, lengths: list[int], max_request_tokens: int, eos=(),
             runner=None, clock=None) -> dict:
    """One batch through the engine (model; or `runner` on `clock`, the simulator's): the requests' token times,
    the step records and the speculation counters, as one row of figures."""
    spec = None if k == 0 else Speculation(drafter, k_max if k == ADAPTIVE else int(k), k == ADAPTIVE, cost)
    kw = {"runner": runner, "clock": clock} if runner is not None else {}
    eng = build_engine(model, PolicySpec.of("continuous", len(prompts)), max_request_tokens, eos_ids=eos,
                       speculation=spec, **kw)
    eng.restart()
    reqs = [eng.add_request(str(i), p, SamplingParams(max_new_tokens=n, ignore_eos=runner is not None))
            for i, (p, n) in enumerate(zip(prompts, lengths))]
    while eng.has_work():
        eng.step()
    steps = eng.take_records()
    end = max(r.token_times[-1] for r in reqs)
    tpot = [(r.token_times[-1] - r.token_times[0]) / (len(r.output) - 1) for r in reqs if len(r.output) > 1]
    itl = np.concatenate([np.diff(np.unique(r.token_times)) for r in reqs] + [np.zeros(0)])  # s between steps
    tokens = sum(len(r.output) for r in reqs)
    row = {"tokens": tokens, "makespan_s": end, "throughput_tok_s": tokens / end, "tpot_p50_ms": pct(tpot, 50) * 1e3,
           "itl_p99_ms": pct(itl, 99) * 1e3 if len(itl) else float("nan"),
           "ttft_p50_ms": pct([r.token_times[0] - r.arrival for r in reqs], 50) * 1e3, "steps": len(steps),
           "outputs": [len(r.output) for r in reqs], "prompt_tokens": [len(r.prompt) for r in reqs],
           "tokens_digest": hash(tuple(tuple(r.output) for r in reqs))}
    if spec is not None:
        row.update({"drafted_rows": spec.num_drafts, "draft_tokens": spec.num_draft_tokens,
                    "accepted": spec.num_accepted, "acceptance": spec.acceptance,
                    "acceptance_rate": spec.num_accepted / max(1, spec.num_draft_tokens),
                    "tokens_per_verified_row": 1 + spec.num_accepted / max(1, spec.num_drafts),
                    "proposed_share": spec.num_drafts / max(1, spec.num_asked),
                    "draft_length": spec.num_draft_tokens / max(1, spec.num_drafts),
                    "chosen_k": {str(kk): n for kk, n in sorted(spec.chosen_k.items())}})
    return row


def measure(net, tokenizer, bench, lookup: tuple[int, int], cost, max_request_tokens: int, eos) -> list[dict]:
    """Every (workload, batch, k) cell of `bench` (workloads, batches, ks, max_new_tokens, repeats), each run
    `repeats` times interleaved with the batch's other ks, the fastest run kept."""
    ks = list(bench.ks)
    if 0 not in ks:
        raise ValueError(f"bench.speculation.ks = {ks}: needs 0, the cells' reference")
    k_max = max(k for k in ks if k != ADAPTIVE)
    rows = []
    for workload in bench.workloads:
        for batch in bench.batches:
            prompts = WORKLOADS[workload](int(batch), tokenizer)
            lengths = [int(bench.max_new_tokens)] * len(prompts)
            best = {}
            for _ in range(int(bench.repeats)):
                for k in ks:
                    row = run_cell(net, prompts, k, k_max, NgramDrafter(*lookup), cost, lengths, max_request_tokens,
                                   eos)
                    if k not in best or row["makespan_s"] < best[k]["makespan_s"]:
                        best[k] = row
            digest = {k: best[k].pop("tokens_digest") for k in ks}
            for k in ks:  # greedy: every k's tokens are k = 0's (a near-tie the verification rows flip: False)
                rows.append({"workload": workload, "batch": int(batch), "k": str(k), **best[k],
                             "tokens_equal_k0": digest[k] == digest[0]})
                print({key: v for key, v in rows[-1].items() if key not in ("outputs", "prompt_tokens")}, flush=True)
    return rows


def simulate(rows: list[dict], cost, max_request_tokens: int, seed: int = 0) -> list[dict]:
    """Each measured row's prediction: its batch's prompts' lengths and outputs through the simulator."""
    k_max = max(int(r["k"]) for r in rows if r["k"] != ADAPTIVE)
    top = {(r["workload"], r["batch"]): r for r in rows if r["k"] == str(k_max)}
    out = []
    for r in rows:
        rates = top[(r["workload"], r["batch"])] if r["k"] == ADAPTIVE else r
        clock = VirtualClock()
        runner = SimRunner(cost, clock, acceptance=rates.get("acceptance", 0.0), seed=seed)
        drafter = RateDrafter(rates.get("proposed_share", 0.0), rates.get("draft_length", 0.0), seed + 1)
        prompts = [[1] * r["prompt_tokens"][i] for i in range(r["batch"])]
        sim = run_cell(None, prompts, r["k"] if r["k"] == ADAPTIVE else int(r["k"]), k_max, drafter, cost,
                       r["outputs"], max_request_tokens, runner=runner, clock=clock)
        out.append({key: sim[key] for key in ("throughput_tok_s", "tpot_p50_ms", "itl_p99_ms", "makespan_s")})
    return out


def stops_paying(rows: list[dict], workload: str, margin: float = 0.03) -> dict[str, int | None]:
    """Per figure (throughput, TPOT p50), the smallest batch at which no fixed k > 0 gains `margin` over k = 0
    (throughput x (1 + margin), TPOT x (1 - margin)); None: it pays at every batch measured."""
    out = {}
    for figure, better in (("throughput_tok_s", lambda r, b: r > b * (1 + margin)),
                           ("tpot_p50_ms", lambda r, b: r < b * (1 - margin))):
        out[figure] = None
        for batch in sorted({r["batch"] for r in rows if r["workload"] == workload}):
            cell = {r["k"]: r for r in rows if r["workload"] == workload and r["batch"] == batch}
            if not any(better(r[figure], cell["0"][figure]) for k, r in cell.items() if k not in ("0", ADAPTIVE)):
                out[figure] = batch
                break
    return out
