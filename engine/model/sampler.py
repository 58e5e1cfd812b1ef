"""Batched next-token choice: penalties, then greedy rows by argmax and sampled rows by temperature, top-k, top-p
and a per-request seed; logprobs of the chosen token and its top alternatives for rows that ask.

Rows with ignore_eos never pick an end-of-sequence id (its logits are set to -inf, as min_new_tokens does in
Hugging Face generate and ignore_eos does in llama.cpp's server).

Every tensor made here lives on the logits' device, and so do the per-request generators (a CUDA run draws on
the GPU), so sampling reads nothing back from the device but the chosen ids.
"""
import torch

from engine.model.device import to_device


def first_argmax(x: torch.Tensor, ops=None, block: int = 1024) -> torch.Tensor:
    """argmax over the last dim (the first maximum, as torch.argmax): fp32 on a CPU by the native kernel where `ops`
    (engine/kernels/build.py's) is given, else by block maxima (argmax's index-tracking loop is not vectorized; amax
    is)."""
    if ops is not None and x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(-1) == 1:
        return ops.first_argmax(x)
    rows, n = x.shape
    if n % block or n == block:
        return x.argmax(dim=-1)
    blocks = x.view(rows, n // block, block)
    first = blocks.amax(dim=-1).argmax(dim=-1)  # the first block holding the row's maximum
    return first * block + blocks[torch.arange(rows, device=x.device), first].argmax(dim=-1)


def token_logprobs(logprobs: torch.Tensor, tokens: list[int], ks: list[int]) -> list[tuple]:
    """logprobs: [R, vocab] log-softmax rows; per row (chosen token's logprob, ((id, logprob), ...) top ks[i])."""
    chosen = logprobs.gather(1, to_device(tokens, logprobs.device)[:, None])[:, 0].tolist()
    k = max(ks)
    top_lp, top_id = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_lp, top_id = top_lp.tolist(), top_id.tolist()
    return [(c, tuple(zip(ids[:n], lps[:n]))) for c, ids, lps, n in zip(chosen, top_id, top_lp, ks)]


class Sampler:
    def __init__(self, seed: int = 0, eos_ids=(), ops=None):
        """ops: the native kernels the model runs (its `ops`), or None."""
        self.eos_ids, self.ops = list(eos_ids), ops
        self._engine_rng = torch.Generator().manual_seed(seed)   # draws the seeds of requests that bring none
        self._rngs: dict[str, torch.Generator] = {}               # rid -> its own generator, on the logits' device

    def forget(self, rid: str) -> None:
        self._rngs.pop(rid, None)

    def _rng(self, rid: str, seed: int | None, device: torch.device) -> torch.Generator:
        if rid not in self._rngs:
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._engine_rng))
            # the meta device has no generator; a CPU one there still yields meta tensors (shapes, no data)
            self._rngs[rid] = torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)
        return self._rngs[rid]

    def __call__(self, logits: torch.Tensor, rids: list[str], params: list,
                 seen: dict[str, tuple[list[int], list[int]]] | None = None,
                 proposed: list[int | None] | None = None) -> list[int]:
        """logits: [R, vocab] float32, edited in place; params[i]: the SamplingParams of row i; seen: rid ->
        (prompt ids, output ids) for the rows with penalties; proposed[i]: a draft token to test at row i (None:
        none). Returns one token id per row: a greedy row's argmax; a sampled row's draw, or with a draft d, d with
        probability p(d) and else a draw from p without d (rejection sampling, exact against a point-mass draft)."""
        dev = logits.device
        no_eos = [i for i, p in enumerate(params) if p.ignore_eos]
        if no_eos and self.eos_ids:
            rows = to_device(no_eos, dev)[:, None]
            logits[rows, to_device(self.eos_ids, dev)[None, :]] = float("-inf")
        hurt = [i for i, p in enumerate(params) if p.penalized]
        if hurt:
            idx = to_device(hurt, dev)
            logits[idx] = self._penalize(logits[idx], [params[i] for i in hurt], [seen[rids[i]] for i in hurt])
        tokens = first_argmax(logits, self.ops)
        hot = [i for i, p in enumerate(params) if p.temperature > 0]
        if hot:
            idx = to_device(hot, dev)
            tokens[idx] = self._sample(logits[idx], [rids[i] for i in hot], [params[i] for i in hot],
                                       [proposed[i] for i in hot] if proposed else None)
        return tokens.tolist()

    @staticmethod
    def _penalize(logits: torch.Tensor, params: list, seen: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        """Repetition penalty over prompt + output tokens, then frequency and presence over output tokens
        (vLLM's order); one scatter per token list (prompts, outputs) for all rows."""
        dev, (rows, vocab) = logits.device, logits.shape

        def counts(lists: list[list[int]]) -> torch.Tensor:
            row = to_device([r for r, ids in enumerate(lists) for _ in ids], dev, torch.long)
            ids = to_device([t for ids in lists for t in ids], dev, torch.long)
            out = torch.zeros(rows, vocab, dtype=logits.dtype, device=dev)
            return out.index_put_((row, ids), torch.ones(len(ids), dtype=logits.dtype, device=dev), accumulate=True)

        output = counts([o for _, o in seen])
        anywhere = (counts([p for p, _ in seen]) + output) > 0
        rep = to_device([p.repetition_penalty for p in params], dev, logits.dtype)[:, None]
        logits = torch.where(anywhere, torch.where(logits > 0, logits / rep, logits * rep), logits)
        freq = to_device([p.frequency_penalty for p in params], dev, logits.dtype)[:, None]
        pres = to_device([p.presence_penalty for p in params], dev, logits.dtype)[:, None]
        return logits - freq * output - pres * (output > 0).to(logits.dtype)

    def _sample(self, logits: torch.Tensor, rids: list[str], params: list, proposed=None) -> torch.Tensor:
        dev, vocab = logits.device, logits.shape[1]
        temp = to_device([p.temperature for p in params], dev, logits.dtype)[:, None]
        logits = logits / temp
        top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], dev)
        top_p = to_device([p.top_p for p in params], dev, logits.dtype)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=dev)[None, :]
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs                 # keep a token while the mass before it < top_p
        drop = (rank >= top_k[:, None]) | (mass_before >= top_p)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        gens = [self._rng(r, p.seed, dev) for r, p in zip(rids, params)]
        u = torch.stack([torch.rand(vocab, generator=g, device=dev) for g in gens])
        gumbel = -torch.log(-torch.log(u.clamp_(1e-20, 1.0)))     # Gumbel-max: argmax(logit + G) ~ softmax
        tested = [i for i, d in enumerate(proposed or ()) if d is not None]
        if tested:  # draft d: kept with probability p(d); else d is out of the draw (the residual, p without d)
            idx, d = to_device(tested, dev), to_device([proposed[i] for i in tested], dev)[:, None]
            place = (order[idx] == d).int().argmax(dim=-1)        # d's rank in its row
            p_d = sorted_logits[idx].softmax(dim=-1).gather(1, place[:, None])[:, 0]
            draws = torch.cat([torch.rand(1, generator=gens[i], device=dev) for i in tested])
            keep = draws < p_d
            sorted_logits[idx, place] = float("-inf")
        choice = (sorted_logits + gumbel).argmax(dim=-1)
        tokens = order.gather(1, choice[:, None])[:, 0]
        if tested:
            tokens[idx] = torch.where(keep, d[:, 0], tokens[idx])
        return tokens
