"""Shared prompt prefixes at a target prefix-cache hit ratio (Mooncake's conversation trace: 40 % of prompt tokens
found in the cache, in blocks of 512 tokens): each request may start with whole blocks of an earlier request's prompt,
as a conversation's next turn starts with its history.

The hit ratio counts, over the prompts in order with an unlimited cache, the tokens of each prompt's leading whole
blocks that an earlier prompt already holds (at most its length - 1 tokens: the last one is always computed), over
all prompt tokens.
"""
import numpy as np


def plan_prefixes(rng, lengths, ratio: float, block: int, window: int,
                  sessions: np.ndarray | None = None) -> list[tuple[int, int]]:
    """Per request (earlier request it continues or -1, tokens it takes from that one's start). Each request takes
    the whole blocks that bring the running hit ratio back to `ratio`, from a random one of the `window` requests
    before it that holds them (else the one holding most). With `sessions` (a conversation id per request) a request
    continues only its own conversation: the latest of its last `window` turns that holds the blocks."""
    full, plan, hit, total, turns = [], [], 0, 0, {}
    for j, length in enumerate(int(x) for x in lengths):
        total += length
        want = min((length - 1) // block, max(0, round((ratio * total - hit) / block)))
        parent, take = -1, 0
        earlier = (np.arange(max(0, j - window), j) if sessions is None
                   else np.asarray(turns.setdefault(int(sessions[j]), [])[-window:], dtype=int))
        if want and len(earlier):
            holds = np.asarray([full[i] for i in earlier])
            enough = earlier[holds >= want]
            if not len(enough):
                parent = int(earlier[np.argmax(holds)])
            else:
                parent = int(rng.choice(enough)) if sessions is None else int(enough[-1])
            take = min(want, full[parent])
        if sessions is not None:
            turns[int(sessions[j])].append(j)
        hit += take * block
        full.append(length // block)
        plan.append((parent if take else -1, take * block))
    return plan


def apply_prefixes(prompts: list[list[int]], plan) -> list[list[int]]:
    """Each prompt with its start replaced by the planned earlier prompt's start (lengths kept)."""
    out = []
    for own, (parent, take) in zip(prompts, plan):
        out.append(out[parent][:take] + own[take:] if take else own)
    return out


def hit_ratio(prompts, block: int) -> float:
    """The prefix-cache hit ratio of the prompts in order (see the module)."""
    seen, hit, total = set(), 0, 0
    for p in prompts:
        key, found, leading = None, 0, True
        for b in range(len(p) // block):
            key = hash((key, tuple(p[b * block:(b + 1) * block])))
            if leading and key in seen and (b + 1) * block <= len(p) - 1:
                found += block
            else:
                leading = False
            seen.add(key)
        hit, total = hit + found, total + len(p)
    return hit / total if total else 0.0
