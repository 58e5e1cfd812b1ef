"""Accuracy tiers: each peer level and lab level placed by its accuracy on the lab's stream (logprobs.py), then per
tier, mode and concurrency the fastest lab level against the fastest peer level among those at least that accurate
(a user who accepts a tier's loss takes the fastest level within it)."""
TIERS = ("lossless", "near-lossless", "lossy")


def tier_rule(cfg) -> dict:
    """lossless: mean KLD within lossless_kld times the floor's and top-1 without near-ties at least lossless_top1
    (bench.precision, the lab's own rule); near-lossless: mean KLD at most near_lossless_kld (bench.peer.accuracy)."""
    p = cfg.bench.precision
    return {"lossless_kld": float(p.lossless_kld), "lossless_top1": float(p.lossless_top1),
            "near_lossless_kld": float(cfg.bench.peer.accuracy.near_lossless_kld)}


def tier(tf: dict | None, rule: dict) -> str | None:
    """A row's tier from its teacher_forced figures (None: not measured)."""
    if not tf or "kld_mean" not in tf:
        return None
    floor = max(rule["floor"]["kld_mean"], 1e-12)
    if tf["kld_mean"] <= rule["lossless_kld"] * floor and tf["top1_no_ties"] >= rule["lossless_top1"]:
        return TIERS[0]
    return TIERS[1] if tf["kld_mean"] <= rule["near_lossless_kld"] else TIERS[2]


def best(rows: list[dict], within: str, rule: dict) -> dict | None:
    """The fastest of `rows` whose tier is `within` or a more accurate one."""
    ok = [r for r in rows if r["throughput_tps"] and tier(r.get("teacher_forced"), rule) in
          TIERS[:TIERS.index(within) + 1]]
    return max(ok, key=lambda r: r["throughput_tps"], default=None)


def tiered(rows: list[dict], rule: dict, lab: str) -> list[dict]:
    """Per tier, mode and concurrency: the fastest lab level (backend starting with `lab`) and peer level within it,
    and their throughput ratio."""
    out = []
    for t in TIERS:
        for mode in dict.fromkeys(r["mode"] for r in rows):
            for c in sorted({r["concurrency"] for r in rows if r["mode"] == mode}):
                here = [r for r in rows if r["mode"] == mode and r["concurrency"] == c]
                a = best([r for r in here if r["backend"].startswith(lab)], t, rule)
                b = best([r for r in here if not r["backend"].startswith(lab)], t, rule)
                out.append({"tier": t, "mode": mode, "concurrency": c, "lab": a, "peer": b,
                            "ratio": a["throughput_tps"] / b["throughput_tps"] if a and b else None})
    return out
