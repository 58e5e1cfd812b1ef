"""A fleet in simulation: replicas of the real engine (each its scheduler, K/V pool and prefix cache) on one virtual
time line, a router (engine/router.py) in front. Each replica keeps its own clock; the replica furthest behind runs its
next step, and a request is routed when every busy replica has reached its arrival time (an idle one waits there), so
the router sees the fleet as it stands at that moment. Lengths come from the workload (token 0 sampled).

Colocated: every replica runs prompts and decodes (chunked prefill mixes them). Split (prefill and decode apart,
DistServe / Splitwise): the router sends a request to a prefill replica, which computes its prompt and its first
token; its K/V then crosses the link (latency + prompt tokens x K/V bytes per token / link bandwidth) into the
prefix cache of the least loaded decode replica, which decodes the rest (the prompt's last partial block, under one
block, is computed again there)."""
import heapq
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pandas as pd

from engine import SamplingParams
from engine.core.simulator import SimRunner, VirtualClock
from engine.factory import build_engine
from engine.router import Router, RouterSpec
from pipeline.config import kv_spec, policy_spec
from pipeline.measuring.metrics import summarize
from pipeline.measuring.replay import STEP_FIELDS, records

INF = float("inf")


@dataclass(frozen=True)
class Split:
    """Prefill and decode apart: `prefill` + `decode` replicas, the K/V handed over a link."""
    prefill: int
    decode: int
    link_bytes_s: float      # bytes per second of one hand-over
    latency_s: float         # s per hand-over besides its bytes
    kv_bytes_per_token: int  # bytes of one token's K/V (all layers)

    def __post_init__(self):
        if self.prefill < 1 or self.decode < 1 or self.link_bytes_s <= 0 or self.latency_s < 0:
            raise ValueError(f"a split needs >= 1 prefill and >= 1 decode replica and a link > 0 B/s, latency >= 0; "
                             f"got {self.prefill}P{self.decode}D at {self.link_bytes_s:g} B/s, {self.latency_s:g} s")

    def handover_s(self, tokens: int) -> float:
        return self.latency_s + tokens * self.kv_bytes_per_token / self.link_bytes_s


def simulate_fleet(cost, policy, workload: pd.DataFrame, unit_s: float, max_request_tokens: int,
                   ttft_limit: float, tpot_limit: float, replicas: int, router: RouterSpec, kv="slot",
                   split: Split | None = None, most_late: int | None = None) -> dict:
    """One open-loop run of the workload (arrivals at arrival_steps x unit_s seconds; policy: a conf/policy entry or
    record) over `replicas` colocated engines, or `split`'s prefill and decode engines, behind the router: the
    summary row (summarize) with the
    prefix-cache hit rate (prompt tokens found cached where prompts are computed / prompt tokens), the GPUs' replicas
    and each one's requests. A request's session is the workload's `session` column where it has one, else its id.
    most_late: stop once more first tokens than this came later than ttft_limit (the run can no longer meet an SLO
    that allows that many; its row then counts the requests left unfinished as incomplete)."""
    front = split.prefill if split else replicas
    clocks = [VirtualClock() for _ in range(front + (split.decode if split else 0))]
    engines = [build_engine(None, policy_spec(policy), max_request_tokens, runner=SimRunner(cost, c), clock=c,
                            kv=kv_spec(kv)) for c in clocks]
    routers = [Router(router, front)] + ([Router(RouterSpec("least_loaded"), split.decode)] if split else [])
    talks = dict(zip(workload["rid"], workload["session"] if "session" in workload else workload["rid"]))
    prompts = dict(zip(workload["rid"], workload["prompt"]))
    wanted = dict(zip(workload["rid"], workload["output_tokens"].astype(int)))
    events = [(float(r.arrival_steps) * unit_s, i, r.rid, None) for i, r in enumerate(workload.itertuples())]
    heapq.heapify(events)  # (time s, order, rid, the prefill side's request for a hand-over, else None)
    first, second, steps, served, lost, late = {}, {}, [[] for _ in engines], [0] * len(engines), 0, 0
    order = len(events)
    until = [0.0] * len(engines)  # a replica that could run nothing waits: for its batching deadline, or (inf) work
    while True:
        ready = {i: max(clocks[i].t, until[i]) for i, e in enumerate(engines) if e.has_work()}
        nxt = min(ready, key=lambda i: (ready[i], i)) if ready else None
        if nxt is not None and ready[nxt] < INF and (not events or ready[nxt] < events[0][0]):
            clocks[nxt].advance_to(ready[nxt])
            done, ran = engines[nxt].step(), engines[nxt].take_records()
            back = nxt >= front
            if not back:
                late += sum(1 for e in done if e.token is not None and len(first[e.rid].token_times) == 1
                            and first[e.rid].token_times[0] - first[e.rid].arrival > ttft_limit)
                if most_late is not None and late > most_late:
                    break
            for e in (e for e in done if e.finish_reason):
                routers[back].finished(e.rid)
                if split and not back and wanted[e.rid] > 1:
                    order += 1
                    heapq.heappush(events, (clocks[nxt].t + split.handover_s(len(prompts[e.rid])), order, e.rid,
                                            first[e.rid]))
            steps[nxt] += ran
            wake = None if ran else engines[nxt].wake_time()
            until[nxt] = 0.0 if ran else (wake if wake is not None and wake > clocks[nxt].t else INF)
            continue
        if not events:
            break
        t, _, rid, handed = heapq.heappop(events)
        prompt = np.asarray(prompts[rid]).tolist()  # python ints
        if handed is None:
            to = routers[0].route(rid, prompt, 1 if split else wanted[rid], talks[rid])
            new = first
            params = SamplingParams(max_new_tokens=1 if split else wanted[rid], ignore_eos=True)
        else:
            to = front + routers[1].route(rid, prompt, wanted[rid] - 1)
            lost += not receive(engines[to], prompt)
            new, prompt = second, prompt + handed.output
            params = SamplingParams(max_new_tokens=wanted[rid] - 1, ignore_eos=True)
        clocks[to].advance_to(t)  # an idle replica waits for it; a busy one is there already
        new[rid] = engines[to].add_request(rid, prompt, params, arrival=t)
        until[to], served[to] = 0.0, served[to] + 1
    req = records(workload, {rid: joined(r, second.get(rid)) for rid, r in first.items()})
    rows = [vars(s) for s in sum(steps[:front], [])]  # a hand-over found on a decode replica is no cache hit:
    rows += [{**vars(s), "cached_tokens": 0} for s in sum(steps[front:], [])]  # its tokens were computed once
    out = summarize(req, pd.DataFrame(rows, columns=STEP_FIELDS), ttft_limit, tpot_limit)
    prompt_tokens = int(workload["prompt_tokens"].sum())
    return {**out, "replicas": len(engines), "router": router.policy, "served": served,
            "split": f"{split.prefill}P{split.decode}D" if split else "colocated", "handovers_recomputed": lost,
            "prefix_hit_rate": out.get("cached_tokens", 0) / prompt_tokens if prompt_tokens else 0.0}


def receive(engine, prompt: list[int]) -> bool:
    """A prompt's K/V arrives: its whole blocks registered in the engine's prefix cache, unheld (the request that
    follows takes them when admitted). False, placing nothing, when the pool has no room (it is computed again)."""
    pool, tokens, tmp = engine.scheduler.blocks, (lambda s, e: prompt[s:e]), "\0handover"
    if pool is None:
        raise ValueError("prefill and decode apart need paged K/V (kv=paged) on the decode replicas")
    if not pool.can_allocate(len(prompt) + 1, tokens):
        return False
    looked = pool.queried_tokens, pool.hit_tokens  # a hand-over is no prefix-cache lookup
    pool.allocate(tmp, len(prompt) + 1, tokens)
    pool.cache(tmp, len(prompt), tokens)
    pool.free(tmp)
    pool.queried_tokens, pool.hit_tokens = looked
    return True


def joined(head, tail):
    """A request served in two parts (its first token on a prefill replica, the rest on a decode one) as one."""
    if tail is None:
        return head
    return SimpleNamespace(arrival=head.arrival, admit_time=head.admit_time, finish_time=tail.finish_time,
                           token_times=list(head.token_times) + list(tail.token_times),
                           finish_reason=tail.finish_reason, output=list(head.output) + list(tail.output))
