"""Every side's accuracy on one token stream, teacher-forced, against the lab's fp32 (each peer row's and lab row's
"teacher_forced" in peer.json): the first bench.peer.accuracy.sequences of the model's stream (check_precision's),
each side's top-k log-probabilities of the next token at every position but a sequence's last. vLLM: its server's
prompt_logprobs; llama.cpp: its server's n_probs after each prefix (one token more each request, its prompt cache
holding the rest); OpenVINO: its exported model's logits through optimum-intel (the same IR and plugin, not its
pipeline's own attention path: estimated); the lab: each level's logits.

A position scores KL(p_fp32 || q) over the side's top-k ids, both distributions renormalised on them, times fp32's
mass on them: a lower bound of the whole KL (the chain rule drops two non-negative terms) that a common shift of a
peer's log-probabilities (its float32 log-softmax) leaves unchanged; and top-1: the side's first id against fp32's
argmax (near-ties, fp32's top two within bench.precision.near_tie, counted apart). The floor: fp32 through another
product kernel, scored alike."""
import httpx
import torch

from engine.factory import build_net
from pipeline.measuring.accuracy import logits_of, other_product, reference, stream_for
from pipeline.measuring.levels import level_nets

Tops = tuple[torch.Tensor, torch.Tensor]  # one sequence's top-k ids [P, k] (int64) and log-probabilities [P, k]


def top_k(logits: torch.Tensor, k: int) -> Tops:
    """A net's top-k ids and log-probabilities at each position."""
    lp, ids = logits.double().log_softmax(-1).topk(k, dim=-1)
    return ids, lp


class Judge:
    """The lab's fp32 on the stream: its logits per sequence, and each side's top-k scored against them."""

    def __init__(self, cfg):
        a, p = cfg.bench.peer.accuracy, cfg.bench.precision
        self.k, self.near_tie = int(a.top_k), float(p.near_tie)
        _, self.model, self.tokenizer, self.ref = reference(cfg)  # the Hugging Face fp32 model, its fp32 net
        self.seqs, self.stream = stream_for(cfg.model.name, self.ref, self.tokenizer, self.model.config.vocab_size,
                                            int(a.sequences), int(p.tokens), int(cfg.seed))
        self.hold([logits_of(self.ref, [s]) for s in self.seqs])

    def hold(self, logits: list[torch.Tensor]) -> None:
        """fp32's logits per sequence ([len - 1, vocab] each), its argmax and near-ties, once for every side."""
        top2 = [x.topk(2, dim=-1) for x in logits]
        self.logits, self.argmax = logits, [t.indices[:, 0] for t in top2]
        self.ties = [t.values[:, 0].double() - t.values[:, 1].double() < self.near_tie for t in top2]  # logit gaps

    def score(self, tops: list[Tops]) -> dict:
        """The pooled figures of one side's top-k at every position (`tops`: one per sequence)."""
        kld, top1 = [], []
        for ref, best, (ids, lq) in zip(self.logits, self.argmax, tops):
            on = ref.double().log_softmax(-1).gather(1, ids)  # fp32's log-probabilities of the side's ids
            mass = on.logsumexp(-1)
            lp_s, lq_s = on - mass[:, None], lq.double() - lq.double().logsumexp(-1)[:, None]
            kld.append(mass.exp() * (lp_s.exp() * (lp_s - lq_s)).sum(-1))
            top1.append(ids.gather(1, lq.argmax(-1, keepdim=True))[:, 0] == best)
        kld, top1, tie = torch.cat(kld).clamp(min=0), torch.cat(top1), torch.cat(self.ties)
        return {"positions": int(kld.numel()), "top_k": self.k, "kld_mean": float(kld.mean()),
                "kld_p99": float(kld.quantile(0.99)), "top1": float(top1.float().mean()),
                "top1_no_ties": float(top1[~tie].float().mean()), "near_ties": int(tie.sum())}

    def fetched(self, fetch, through: str) -> dict:
        """score() of the top-k that fetch(seqs, k) gets from a peer, or the peer's own error where it gives none;
        through: how they were got, in words."""
        try:
            return {**self.score(fetch(self.seqs, self.k)), "through": through}
        except (httpx.HTTPError, OSError, KeyError, IndexError, TypeError, ValueError) as exc:  # OSError: a driver gone
            return {"error": f"{type(exc).__name__}: {exc}", "through": through}

    def net(self, net) -> dict:
        """A lab net's figures (its products pinned to its 1-row decode kernels, as check_precision judges them)."""
        net.pin_kernels(0)
        return self.scored(net, "its logits, each product in its 1-row kernel")

    def floor(self) -> dict:
        """fp32 against fp32 through another product kernel."""
        other = other_product(self.ref)
        return self.scored(build_net(self.model, kernel=other), f"fp32 through the {other} product")

    def scored(self, net, through: str) -> dict:
        """score() of a lab net's own logits on the stream."""
        return {**self.score([top_k(logits_of(net, [s]), self.k) for s in self.seqs]), "through": through}

    def lab(self, cfg, names: list[str]) -> dict[str, dict]:
        """Each of the lab's levels in `names`, one built at a time."""
        out = {}
        for name in names:
            built, _, _ = level_nets(cfg, [name])
            if name in built:
                out[name] = self.net(built[name][0])
        return out

    def settings(self, floor: dict) -> dict:
        """What PEER.md says of the stream and the scoring (floor: floor()'s figures)."""
        return {"stream": self.stream, "sequences": len(self.seqs), "top_k": self.k, "floor": floor,
                "near_tie": self.near_tie}


def vllm_tops(base_url: str, seqs: list[list[int]], k: int) -> list[Tops]:
    """vLLM's prompt_logprobs of each sequence, its k most likely at each position (the sequence's own token, added
    where it is not among them, left out)."""
    out = []
    for s in seqs:
        r = httpx.post(f"{base_url}/completions", timeout=600, json={
            "model": "peer", "prompt": s, "max_tokens": 1, "temperature": 0, "prompt_logprobs": k})
        r.raise_for_status()
        rows = [sorted(((int(t), float(v["logprob"])) for t, v in d.items()), key=lambda x: -x[1])[:k]
                for d in r.json()["choices"][0]["prompt_logprobs"][1:]]
        out.append(as_tops(rows))
    return out


def llama_tops(base_url: str, seqs: list[list[int]], k: int) -> list[Tops]:
    """llama.cpp's n_probs of the next token after each prefix of each sequence (its probabilities of the full
    logits, before sampling)."""
    out = []
    with httpx.Client(timeout=600) as client:
        for s in seqs:
            rows = []
            for j in range(1, len(s)):
                r = client.post(f"{base_url}/completion", json={"prompt": s[:j], "n_predict": 1, "n_probs": k,
                                                                 "cache_prompt": True, "temperature": 0})
                r.raise_for_status()
                rows.append([(int(t["id"]), float(t["logprob"]))
                             for t in r.json()["completion_probabilities"][0]["top_logprobs"]])
            out.append(as_tops(rows))
    return out


def as_tops(rows: list[list[tuple[int, float]]]) -> Tops:
    """Rows of (id, log-probability) pairs, most likely first, as one sequence's Tops."""
    return (torch.tensor([[t for t, _ in r] for r in rows], dtype=torch.int64),
            torch.tensor([[v for _, v in r] for r in rows], dtype=torch.float64))
