"""A fleet in simulation: N replicas of the real engine (each its scheduler, K/V pool and prefix cache) on one virtual
time line, a router (engine/router.py) in front. Each replica keeps its own clock; the replica furthest behind runs its
next step, and a request is routed when every busy replica has reached its arrival time (an idle one waits there), so
the router sees the fleet as it stands at that moment. Lengths come from the workload (token 0 sampled)."""
import pandas as pd

from engine import SamplingParams
from engine.core.simulator import SimRunner, VirtualClock
from engine.factory import build_engine
from engine.router import Router, RouterSpec
from pipeline.config import kv_spec, policy_spec
from pipeline.measuring.metrics import summarize
from pipeline.measuring.replay import STEP_FIELDS, records

INF = float("inf")


def simulate_fleet(cost, policy: dict, workload: pd.DataFrame, step_s: float, max_request_tokens: int,
                   ttft_limit: float, tpot_limit: float, replicas: int, router: RouterSpec, kv="slot") -> dict:
    """One open-loop run of the workload over `replicas` engines behind the router: the summary row (summarize)
    with the fleet's prefix-cache hit rate (cached prompt tokens / prompt tokens) and each replica's requests. A
    request's session is the workload's `session` column where it has one, else its own id."""
    clocks = [VirtualClock() for _ in range(replicas)]
    engines = [build_engine(None, policy_spec(policy), max_request_tokens, runner=SimRunner(cost, c), clock=c,
                            kv=kv_spec(kv)) for c in clocks]
    route = Router(router, replicas)
    rows = workload.sort_values("arrival_steps", kind="stable").to_dict("records")
    talks = dict(zip(workload["rid"], workload["session"] if "session" in workload else workload["rid"]))
    reqs, steps, served, nxt = {}, [], [0] * replicas, 0
    until = [0.0] * replicas  # a replica that could run nothing waits: for its batching deadline, or (inf) a request
    while True:
        ready = {i: max(clocks[i].t, until[i]) for i, e in enumerate(engines) if e.has_work()}
        arrival = float(rows[nxt]["arrival_steps"]) * step_s if nxt < len(rows) else None
        first = min(ready, key=lambda i: (ready[i], i)) if ready else None
        if first is not None and ready[first] < INF and (arrival is None or ready[first] < arrival):
            clocks[first].advance_to(ready[first])
            events, ran = engines[first].step(), engines[first].take_records()
            for e in events:
                if e.finish_reason:
                    route.finished(e.rid)
            steps += ran
            wake = None if ran else engines[first].wake_time()
            until[first] = 0.0 if ran else (wake if wake is not None and wake > clocks[first].t else INF)
            continue
        if arrival is None:
            break
        r = rows[nxt]
        to = route.route(r["rid"], r["prompt"], int(r["output_tokens"]), talks[r["rid"]])
        clocks[to].advance_to(arrival)  # an idle replica waits for it; a busy one is there already
        reqs[r["rid"]] = engines[to].add_request(r["rid"], [int(t) for t in r["prompt"]],
                                                 SamplingParams(max_new_tokens=int(r["output_tokens"]),
                                                                ignore_eos=True), arrival=arrival)
        until[to], served[to], nxt = 0.0, served[to] + 1, nxt + 1
    req = records(workload, reqs)
    out = summarize(req, pd.DataFrame([vars(s) for s in steps], columns=STEP_FIELDS), ttft_limit, tpot_limit)
    prompt = int(workload["prompt_tokens"].sum())
    return {**out, "replicas": replicas, "router": router.policy, "served": served,
            "prefix_hit_rate": out.get("cached_tokens", 0) / prompt if prompt else 0.0}
