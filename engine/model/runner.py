"""The model runner: one forward pass per SchedulerOutput, one sampled token per chunk that samples (a drafted row's
drafts verified too, its kept ones going back before it).

It never branches on the policy: a decode, a whole prompt and a prompt chunk are chunks of different lengths. It
picks the step's attention path (engine/model/layers/attention.py) from the step's shape (one per window where layers'
windows differ); only plain values go back. Each step first lets the thread governor (engine/threads.py) follow the
free cores; decode-only steps may run compiled, and with `graphs` padded to few shapes (`_bucketed`).
"""
from dataclasses import replace

import torch

from engine import threads
from engine.core.outputs import RunnerOutput, SchedulerOutput
from engine.model.device import to_device
from engine.model.layers.attention import (
    ByLayer,
    DecodePart,
    DenseDecode,
    EqualPrompts,
    Padded,
    PromptPart,
    Spans,
    StepInputs,
    window_start,
)
from engine.model.sampler import Sampler, token_logprobs


def table(chunk, win) -> tuple[int, ...]:
    """The chunk's block table for layers of window `win`: its own pool's where LayerPools keep one per window."""
    return chunk.blocks if chunk.tables is None else chunk.tables[win]


SAMPLER_SPAN = "lab::sampler"  # the step's token choice, as torch.profiler names it (probe_hardware's step split)
KEY_BUCKET = 128  # keys: decode steps with graphs pad their context to a multiple of this


class ModelRunner:
    def __init__(self, net, cache, seed: int = 0, eos_ids=(), compile: bool = False, graphs: bool = False):
        """net: a FlatModel; cache: its KV cache (engine/model/kv_cache.py); compile: decode-only steps through
        torch.compile; graphs: those steps padded to few shapes, captured as CUDA graphs on CUDA (slot cache)."""
        self.net, self.cache = net, cache
        self.compile = compile
        self.block_size = getattr(cache, "block_size", None)  # None: a seat per request
        self.graphs = graphs and self.block_size is None and not hasattr(cache, "copied_bytes")
        self.device = net.device
        self.sampler = Sampler(seed, eos_ids, net.ops)

    @property
    def vocab_size(self) -> int:
        return self.net.vocab_size

    def _tensor(self, values) -> torch.Tensor:
        return to_device(values, self.device)

    def inputs(self, plan: SchedulerOutput) -> StepInputs:
        """Flatten the chunks into token ids, positions and the seat or block of each, the rows whose logits are
        taken, and the step's attention path."""
        bs = self.block_size
        ids, places, positions, logit_rows, decodes, prompts = [], [], [], [], [], []
        for c in plan.chunks:
            n, t0 = len(c.tokens), len(ids)
            ids.extend(c.tokens)
            positions.extend(range(c.start, c.start + n))
            places.extend([c.seat] * n if bs is None else [c.blocks[p // bs] for p in range(c.start, c.start + n)])
            (decodes if n == 1 else prompts).append((t0, c))
            if c.sample:  # a drafted row's logits at its last token and at each draft
                logit_rows.extend(range(t0 + n - 1 - len(c.draft), t0 + n))
        T = len(ids)  # the four index lists travel as one tensor, split into views
        flat = self._tensor(ids + positions + places + logit_rows).split([T, T, T, len(logit_rows)])
        attention = self._attention(plan.chunks, places, positions, decodes, prompts)
        pools = None  # LayerPools: each window's pool's blocks of the step's tokens
        if plan.chunks and plan.chunks[0].tables is not None:
            pools = {w: self._tensor([c.tables[w][p // bs] for c in plan.chunks
                                      for p in range(c.start, c.start + len(c.tokens))]) for w in plan.chunks[0].tables}
        return StepInputs(*flat, attention, max(positions, default=-1) + 1, pools)

    def _attention(self, chunks, places, positions, decodes, prompts):
        """The step's path for every layer: one, or one per window where layers' windows differ (ByLayer)."""
        paths = {win: self._path(win, chunks, places, positions, decodes, prompts)
                 for win in dict.fromkeys(self.net.windows)}
        return next(iter(paths.values())) if len(paths) == 1 else ByLayer([paths[w] for w in self.net.windows])

    def _path(self, win, chunks, places, positions, decodes, prompts):
        """The path for layers whose queries attend `win` keys (None: every key before them)."""
        if not prompts and self.block_size is None and [c.seat for _, c in decodes] == list(range(len(decodes))):
            return self._dense_decode([c.start + 1 for _, c in decodes], win)
        longest = max((len(c.tokens) for _, c in prompts), default=0)
        if not decodes and all(c.start == 0 and len(c.tokens) == longest for _, c in prompts) \
                and window_start(longest - 1, win) == 0:
            return EqualPrompts(len(prompts), longest)
        if self.net.ops is not None:
            return self._spans(chunks, places, positions, win)
        return Padded(self._decode_part(decodes, win), self._prompt_part(prompts, longest, win))

    def _dense_decode(self, lens: list[int], win) -> DenseDecode:
        length = max(lens)
        masked = any(n != length for n in lens) or window_start(length - 1, win) > 0
        return DenseDecode(len(lens), length, self._bias(lens, length, win) if masked else None)

    def _spans(self, chunks, places, positions, win) -> Spans:
        """Each token's (sequence, first key, end key): its seat (slot cache), or its chunk's index into `key_rows`,
        the rows of every chunk's keys (paged)."""
        bs = self.block_size
        seq = places if bs is None else [i for i, c in enumerate(chunks) for _ in c.tokens]
        spans = [(s, window_start(p, win), p + 1) for s, p in zip(seq, positions)]
        rows = None if bs is None else self._keys([table(c, win) for c in chunks], -(-(max(positions) + 1) // bs) * bs)
        return Spans(self._tensor(spans), rows)

    def _decode_part(self, decodes, win) -> DecodePart | None:
        if not decodes:
            return None
        tokens, lens = self._tensor([t for t, _ in decodes]), [c.start + 1 for _, c in decodes]
        if self.block_size is not None:  # each decode reads whole blocks through its table; keys past it masked
            length = -(-max(lens) // self.block_size) * self.block_size
            return DecodePart(tokens, None, len(lens), length, self._bias(lens, length, win),
                              self._keys([table(c, win) for _, c in decodes], length))
        seats, length = [c.seat for _, c in decodes], max(lens)
        seat_len = [1] * (max(seats) + 1)  # seats not decoding attend to position 0 (discarded)
        for s, n in zip(seats, lens):
            seat_len[s] = n
        masked = any(n != length for n in seat_len) or window_start(length - 1, win) > 0
        return DecodePart(tokens, self._tensor(seats), len(seat_len), length,
                          self._bias(seat_len, length, win) if masked else None)

    def _prompt_part(self, prompts, longest: int, win) -> PromptPart | None:
        """Prompt chunks padded to the longest; paged, their keys' rows (whole blocks through each table)."""
        if not prompts:
            return None
        tokens, grid = [], []
        for p, (t0, c) in enumerate(prompts):
            tokens.extend(range(t0, t0 + len(c.tokens)))
            grid.extend(range(p * longest, p * longest + len(c.tokens)))
        extents = [(c.start, len(c.tokens)) for _, c in prompts]
        length = max(s + n for s, n in extents)
        seats, keys = None, None
        if self.block_size is None:
            seats = self._tensor([c.seat for _, c in prompts])
        else:
            length = -(-length // self.block_size) * self.block_size
            keys = self._keys([table(c, win) for _, c in prompts], length)
        return PromptPart(self._tensor(tokens), self._tensor(grid), seats, (len(prompts), longest, length),
                          self._mask(extents, longest, length, win), keys)

    def _bias(self, lens, length, win):
        """[S, 1, 1, length] additive mask of one query at position n - 1 per sequence (n = lens[i]) against keys
        [0, length): 0 where it attends (within the window `win`), -inf elsewhere."""
        j, p = torch.arange(length, device=self.device)[None, :], self._tensor(lens)[:, None] - 1
        masked = j > p
        if win is not None:  # keys before the window too
            masked |= j < window_start(p, win)
        bias = torch.zeros(masked.shape, dtype=self.net.dtype, device=self.device).masked_fill_(masked, -torch.inf)
        return bias[:, None, None, :]

    def _mask(self, extents, qmax, length, win):
        """[P, 1, qmax, length] bool, True where a chunk's query attends: keys up to its absolute position (and
        within the window `win`); padded query rows see all. None when every chunk starts at 0 and no window cuts
        (SDPA's is_causal, aligned top-left)."""
        if window_start(length - 1, win) == 0 and all(s == 0 for s, _ in extents):
            return None
        starts = self._tensor([s for s, _ in extents])[:, None, None]
        counts = self._tensor([n for _, n in extents])[:, None, None]
        qi = torch.arange(qmax, device=self.device)[None, :, None]
        kj = torch.arange(length, device=self.device)[None, None, :]
        p = starts + qi  # causal by absolute position: a chunk after a cached prefix is aligned to its end
        seen = kj <= p
        if win is not None:
            seen &= kj >= window_start(p, win)
        return (seen | (qi >= counts))[:, None]

    def _keys(self, tables, length):
        """Cache rows [B, kv heads, length] of each sequence's first `length` positions (whole blocks) through its
        block table; positions past a table's end read block 0 (masked)."""
        nb = length // self.block_size
        return self.cache.keys(self._tensor([t[:nb] + (0,) * (nb - len(t)) for t in tables]))

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """One forward pass. Logprobs, for the rows that ask, are the raw model distribution's (fp32 log-softmax of
        the logits before penalties, temperature, top-k and top-p), as vLLM and OpenAI report them. A drafted row
        has a logits row per position: each draft is tested where the target chose (engine/model/sampler.py), the
        agreeing prefix kept, and the first disagreement's choice (or the position after the last draft) sampled."""
        threads.tick()
        for rid in plan.finished_ids:
            self.sampler.forget(rid)
        logits = self._logits(self.inputs(plan))
        rows = [c for c in plan.chunks if c.sample]
        drafted = any(c.draft for c in rows)
        rids = [c.rid for c in rows for _ in range(1 + len(c.draft))]  # a logits row per position of a drafted row
        params = [c.params for c in rows for _ in range(1 + len(c.draft))]
        asked = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw = logits[asked].float().log_softmax(dim=-1) if asked else None  # before the sampler edits logits
        with torch.profiler.record_function(SAMPLER_SPAN):
            picks = self.sampler(logits, rids, params, {c.rid: c.history for c in rows if c.history is not None},
                                 [t for c in rows for t in (*c.draft, None)] if drafted else None)
        logprobs = token_logprobs(raw, [picks[i] for i in asked], [params[i].logprobs for i in asked]) if asked else []
        if not drafted:
            return RunnerOutput(dict(zip(rids, picks)), dict(zip([rids[i] for i in asked], logprobs)))
        return self._verified(rows, picks, dict(zip(asked, logprobs)))

    @staticmethod
    def _verified(rows, picks: list[int], lps: dict) -> RunnerOutput:
        """Drafted rows: each keeps its drafts up to the first where the target chose otherwise, then that choice
        (or, all kept, the one after the last); picks and lps (logprobs by logits row) per logits row."""
        tokens, accepted, logprobs, accepted_logprobs, i = {}, {}, {}, {}, 0
        for c in rows:
            n = 0
            while n < len(c.draft) and picks[i + n] == c.draft[n]:
                n += 1
            tokens[c.rid] = picks[i + n]
            if c.draft:
                accepted[c.rid] = c.draft[:n]
            if i in lps:
                logprobs[c.rid] = lps[i + n]
                if c.draft:
                    accepted_logprobs[c.rid] = tuple(lps[i + j] for j in range(n))
            i += 1 + len(c.draft)
        return RunnerOutput(tokens, logprobs, accepted, accepted_logprobs)

    def _logits(self, inputs: StepInputs) -> torch.Tensor:
        """The net's logits for the step: a step of decodes only (DenseDecode) runs through torch.compile with
        `compile` (each step shape compiled once per process, engine/model/compiled.py; LLMEngine.warm_up compiles
        them all up front), padded to few shapes with `graphs` (_bucketed; on CUDA each captured once as a CUDA graph
        and replayed)."""
        if not (isinstance(inputs.attention, DenseDecode) and (self.compile or self.graphs)):
            return self.net.forward(inputs, self.cache)
        n = inputs.logit_rows.shape[0]
        if self.graphs:
            inputs = self._bucketed(inputs)
        logits = self.net.forward(inputs, self.cache, compiled=self.compile,
                                  cuda_graphs=self.graphs and self.device.type == "cuda")
        return logits[:n].clone() if self.graphs else logits  # a graph's outputs are overwritten by its next replay

    def _bucketed(self, inputs: StepInputs) -> StepInputs:
        """A dense decode step padded to one of few shapes: seats to the next power of two (at most the cache's),
        keys to the next multiple of KEY_BUCKET (at most a seat), each row masked to its own keys. A padded row
        decodes token 0 in its own seat at the seat's last position, which no request ever writes (prompt +
        max_new_tokens fit the seat and the last token is never fed back), and attends every key; its logits are
        dropped. All rows' logits are taken, in seat order."""
        a, dev, cache = inputs.attention, inputs.ids.device, self.cache
        S = a.num_seats
        Sb = min(1 << (S - 1).bit_length(), cache.k[0].shape[0])
        Lb = min(-(-a.length // KEY_BUCKET) * KEY_BUCKET, cache.seat_len)
        rows = torch.arange(Sb, device=dev)
        pos = torch.cat([inputs.positions, inputs.positions.new_full((Sb - S,), cache.seat_len - 1)])
        j, p = torch.arange(Lb, device=dev)[None, :], pos[:, None]
        masked = j > p
        if self.net.window is not None:  # keys before the window too
            masked |= j < window_start(p, self.net.window)
        masked &= (rows < S)[:, None]  # padded rows see every key: no row is all -inf (no NaN written anywhere)
        bias = torch.zeros(masked.shape, dtype=self.net.dtype, device=dev).masked_fill_(masked, -torch.inf)
        ids = torch.cat([inputs.ids, inputs.ids.new_zeros(Sb - S)])
        return replace(inputs, ids=ids, positions=pos, places=rows, logit_rows=rows,
                       attention=DenseDecode(Sb, Lb, bias[:, None, None, :]),
                       end=cache.seat_len if Sb > S else inputs.end)
