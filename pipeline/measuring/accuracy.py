"""What a precision level costs in accuracy, measured against fp32 (reports/precision.json).

A token stream: the project's chat and long prompts, each continued greedily by the fp32 engine; the model's committed
stream (data/streams/<model>.json, pipeline/tools/make_stream.py) where it has one, so that every machine scores the
same positions (fp32's own greedy choices differ between CPUs at near-ties, and so would the positions counted).
Teacher-forced through each level, every position's logits are compared in fp64 with fp32's: KL(p_fp32 || p_level)
(mean, p99, max), top-1 agreement over all positions and over those without a near-tie (the reference's top-2
log-probabilities within bench.precision.near_tie of each other), and the change of the stream's perplexity.
Free-running: each level's greedy outputs for whole requests against fp32's (exact-match rate, first divergences).
The noise floor first: teacher-forced, fp32 against fp32 through another product kernel; free-running, fp32 one
request at a time against fp32 all at once (B=1 against B=many). A level is lossless when its mean KLD is within
bench.precision.lossless_kld times the floor's and its top-1 without near-ties reaches bench.precision.lossless_top1.
"""
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from engine import SamplingParams
from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.factory import build_engine, build_net
from engine.kernels.choice import candidates
from engine.model.kv_cache import make_cache
from engine.model.runner import ModelRunner
from engine.specs import PolicySpec
from pipeline.config import ROOT, compose_config, load_source
from pipeline.measuring.equivalence import first_divergence
from pipeline.workloads.prompts import CHAT, chat_ids, document_ids, long_prompts, short_prompts

ROWS = 512            # positions whose fp64 distributions are held at once
STREAMS = ROOT / "data" / "streams"  # committed token streams: <model>.json {"model", "seed", "tokens", "machine",
                                     # "sequences": [[token ids]]}


def reference(cfg) -> tuple:
    """(the fp32 config, Hugging Face model and tokenizer, the fp32 engine) of cfg's model: what levels are judged
    against and what continues the stream."""
    base = compose_config([f"model={cfg.model.name}", "precision=fp32", f"threads={cfg.threads}"])
    model, tok = load_source(base)
    return base, model, tok, build_net(model)


def other_product(ref) -> str:
    """The product kernel of the noise floor: fp32 through another library's GEMM than the teacher-forced passes of
    `ref` (the fp32 net) use (x @ W and F.linear may share MKL's)."""
    big = {k["choice"][-1] for k in ref.kernels.values()}
    runs = candidates(ref.device, ref.dtype)
    return next((c for c in ("onednn", "packed", "in_out", "linear") if c in runs and c not in big), "linear")


def stream_prompts(n: int, length: int, tokenizer, vocab_size: int, seed: int) -> list[list[int]]:
    """n distinct prompts (greedy continuations of one prompt are one sequence counted again): every fourth a
    numbered document of length / 2 tokens (document_ids), the rest the CHAT questions, then two of them in one turn;
    seeded random ids without a tokenizer."""
    if tokenizer is None:
        return [long_prompts(1, length // 2, None, vocab_size, seed + i)[0] if i % 4 == 3 else p
                for i, p in enumerate(short_prompts(n, None, vocab_size, seed))]
    out = []
    for i in range(n):
        a, k = i % len(CHAT), i // len(CHAT)
        out.append(document_ids(tokenizer, i, length // 2) if i % 4 == 3 else
                   chat_ids(tokenizer, CHAT[a] if k == 0 else f"{CHAT[a]} {CHAT[(a + k) % len(CHAT)]}"))
    return out


def token_stream(net, tokenizer, vocab_size: int, sequences: int, length: int, seed: int) -> list[list[int]]:
    """`sequences` token sequences of `length`: stream_prompts, each continued greedily by the engine `net` (fp32)
    to `length` tokens; EOS neither stops nor is masked."""
    prompts = stream_prompts(sequences, length, tokenizer, vocab_size, seed)
    eng = build_engine(net, PolicySpec("continuous", sequences), length + 1, eos_ids=[])
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=length - len(p), ignore_eos=True) for p in prompts])
    return [p + o for p, o in zip(prompts, outs)]


def committed_stream(path: Path, vocab_size: int) -> dict:
    """A committed stream, read and checked whole: every sequence `tokens` ids below the vocabulary's size. A damaged
    one stops the run naming the file and what mends it (its figures would not be the committed ones)."""
    try:
        s = json.loads(path.read_text())
        seqs, length = s["sequences"], int(s["tokens"])
        whole = (isinstance(seqs, list) and all(isinstance(q, list) and len(q) == length for q in seqs)
                 and all(isinstance(t, int) and 0 <= t < vocab_size for q in seqs for t in q))
        why = None if whole and {"seed", "machine"} <= s.keys() else (
            f"a sequence not {length} tokens long, a token id outside the vocabulary of {vocab_size}, or no seed or "
            "machine")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        why = f"{type(exc).__name__}: {exc}"
    if why:
        rel = path.relative_to(ROOT)
        raise ValueError(f"{rel} is damaged ({why}): restore it with `git checkout -- {rel}`, or delete it to continue "
                         "a new stream on this machine (its figures then differ from the committed ones)")
    return s


def stream_for(model: str, net, tokenizer, vocab_size: int, sequences: int, length: int,
               seed: int) -> tuple[list[list[int]], str]:
    """The first `sequences` of the model's committed stream where it holds that many of `length` tokens at `seed`,
    else token_stream's here; and where they came from."""
    path = STREAMS / f"{model}.json"
    if path.exists():
        s = committed_stream(path, vocab_size)
        if (s["seed"], s["tokens"]) == (seed, length) and len(s["sequences"]) >= sequences:
            return s["sequences"][:sequences], f"{path.relative_to(ROOT)} (continued by fp32 on {s['machine']})"
    return token_stream(net, tokenizer, vocab_size, sequences, length, seed), "continued by fp32 on this machine"


@torch.inference_mode()
def logits_of(net, seqs: list[list[int]]) -> torch.Tensor:
    """fp32 logits [sum of lengths - sequences, vocab] at every position but each sequence's last, all sequences in
    one pass (whole prompts through the engine's forward)."""
    runner = ModelRunner(net, make_cache("slot", net, len(seqs), max(map(len, seqs))))
    plan = SchedulerOutput(tuple(ScheduledChunk(str(i), 0, tuple(s), sample=True, prompt=True, seat=i)
                                 for i, s in enumerate(seqs)))
    inputs = runner.inputs(plan)
    starts = np.cumsum([0] + [len(s) for s in seqs])
    rows = torch.tensor([r for i, s in enumerate(seqs) for r in range(starts[i], starts[i] + len(s) - 1)])
    inputs = replace(inputs, logit_rows=rows)
    return net.forward(inputs, runner.cache)


def compare(ref: torch.Tensor, gots: dict[str, torch.Tensor], targets: torch.Tensor,
            near_tie: float) -> dict[str, dict]:
    """Per-position figures of each name's logits in `gots` against `ref` (fp32 [P, vocab]), in fp64, the reference's
    distribution computed once; targets: the stream's next tokens [P]. Name -> lists to pool: kld, top1, tie (a
    reference near-tie: its top two log-probabilities within near_tie), nll_ref, nll_got. KL(p || q) = sum p (a - b)
    - (lse_a - lse_b) for logits a, b: the small differences a - b are summed, not the large log-probabilities. The
    fp64 rows live in buffers made once per call (fresh ones of this size would be zeroed page by page by the kernel
    each time)."""
    out = {name: {k: [] for k in ("kld", "top1", "tie", "nll_ref", "nll_got")} for name in gots}
    a, p, b, scratch = (ref.new_empty((min(ROWS, ref.shape[0]), ref.shape[1]), dtype=torch.float64) for _ in range(4))
    for s in range(0, ref.shape[0], ROWS):
        n = min(ROWS, ref.shape[0] - s)
        a_, p_, b_, tmp, t = a[:n], p[:n], b[:n], scratch[:n], targets[s:s + n, None]
        a_.copy_(ref[s:s + n])
        lse_a = _logsumexp(a_, tmp)
        torch.sub(a_, lse_a[:, None], out=p_).exp_()
        top2 = ref[s:s + n].topk(2, dim=-1).values.double()
        top_a = ref[s:s + n].argmax(-1)
        for name, got in gots.items():
            g = got[s:s + n]
            b_.copy_(g)
            lse_b = _logsumexp(b_, tmp)
            o = out[name]
            nll_got = lse_b - b_.gather(1, t)[:, 0]
            torch.sub(a_, b_, out=b_)  # a - b
            o["kld"].append(torch.bmm(p_[:, None, :], b_[:, :, None])[:, 0, 0] - (lse_a - lse_b))
            o["tie"].append(top2[:, 0] - top2[:, 1] < near_tie)
            o["top1"].append(top_a == g.argmax(-1))
            o["nll_ref"].append(lse_a - a_.gather(1, t)[:, 0])
            o["nll_got"].append(nll_got)
    return {name: {k: torch.cat(v) for k, v in o.items()} for name, o in out.items()}


def _logsumexp(x: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(-1) as torch computes it (max taken out, infinite maxima as 0), exp(x - max) in `scratch`."""
    m = x.amax(-1)
    m.masked_fill_(~m.isfinite(), 0)
    return torch.sub(x, m[:, None], out=scratch).exp_().sum(-1).log_().add_(m)


def summary(c: dict) -> dict:
    """The pooled figures of compare()."""
    kld, top1, tie = c["kld"].clamp(min=0), c["top1"], c["tie"]
    return {"positions": int(kld.numel()), "kld_mean": float(kld.mean()), "kld_p99": float(kld.quantile(0.99)),
            "kld_max": float(kld.max()), "top1": float(top1.float().mean()),
            "top1_no_ties": float(top1[~tie].float().mean()), "near_ties": int(tie.sum()),
            "ppl_delta": float(c["nll_got"].mean().exp() - c["nll_ref"].mean().exp())}


def teacher_forced(ref_net, nets: dict, seqs: list[list[int]], batch: int, near_tie: float,
                   share: dict | None = None) -> dict[str, dict]:
    """Name -> pooled compare() of each net against ref_net over the stream, `batch` sequences per pass; a name in
    `share` only on the stream's first share[name] sequences (the reference's logits computed once for all)."""
    pooled = {name: [] for name in nets}
    for a in range(0, len(seqs), batch):
        chunk = seqs[a:a + batch]
        here = {name: net for name, net in nets.items() if a < (share or {}).get(name, len(seqs))}
        targets = torch.tensor([t for s in chunk for t in s[1:]])
        got = compare(logits_of(ref_net, chunk), {name: logits_of(net, chunk) for name, net in here.items()}, targets,
                      near_tie)
        for name in here:
            pooled[name].append(got[name])
    return {name: {k: torch.cat([c[k] for c in cs]) for k in cs[0]} for name, cs in pooled.items()}


def greedy(net, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation by the engine, all at once; EOS neither stops nor is masked (no EOS ids)."""
    eng = build_engine(net, PolicySpec("continuous", len(prompts)), max(map(len, prompts)) + new_tokens)
    return eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))


def greedy_agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Whole-request exact matches and where the others first diverge (token index; a shorter output diverges
    where it ends)."""
    first = [first_divergence(r, g) for r, g in zip(ref, got)]
    return {"greedy_exact": sum(f is None for f in first) / len(ref),
            "first_divergences": sorted(f for f in first if f is not None)}


def lossless(level: dict, floor: dict, rule) -> bool:
    """rule: bench.precision (lossless_kld: times the floor's mean KLD at most; lossless_top1: top-1 without
    near-ties at least)."""
    return (level["kld_mean"] <= float(rule.lossless_kld) * max(floor["kld_mean"], 1e-12)
            and level["top1_no_ties"] >= float(rule.lossless_top1))
