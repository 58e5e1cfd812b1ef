"""The model runner: turns a SchedulerOutput into one forward pass and one sampled token per sampling chunk.

It never branches on the policy: a decode, a whole prompt and a prompt chunk are chunks of different lengths.
Only plain Python values go back to the scheduler.
"""
import torch

from engine.device import to_device
from engine.kv_cache import CatCache, PagedCache, SlotCache
from engine.model import AttentionPlan, FlatModel
from engine.sampler import Sampler, token_logprobs
from engine.scheduler import SchedulerOutput

CACHES = {"slot": SlotCache, "cat": CatCache}


class ModelRunner:
    def __init__(self, hf_model, num_seats: int, seat_tokens: int, cache: str = "slot", seed: int = 0, eos_ids=(),
                 compile: bool = False, pool: tuple[int, int] | None = None, graphs: bool = False):
        """pool: (blocks, tokens per block) of a paged cache, which then replaces `cache`; graphs: decode-only steps
        padded to few shapes, captured as CUDA graphs when compiled on CUDA (FlatModel.forward; slot cache only)."""
        self.net = FlatModel.of(hf_model)
        self.compile = compile  # decode-only steps through torch.compile (FlatModel.forward)
        self.graphs = graphs and pool is None and cache == "slot"
        self.device = self.net.embed.device
        self.seat_tokens = seat_tokens
        shape = (self.net.num_kv_heads, self.net.head_dim, self.net.dtype, self.device)
        if pool is None:
            self.cache = CACHES[cache](self.net.num_layers, num_seats, seat_tokens, *shape)
        else:
            self.cache = PagedCache(self.net.num_layers, *pool, *shape)
        self.block_size = None if pool is None else pool[1]  # None: a row per seat
        self.sampler = Sampler(seed, eos_ids)
        self.logprobs: dict[str, tuple] = {}  # rid -> (logprob, top alternatives) of the last run's rows that asked

    @property
    def vocab_size(self) -> int:
        return self.net.vocab_size

    def _tensor(self, values) -> torch.Tensor:
        return to_device(values, self.device)

    def plan(self, out: SchedulerOutput):
        """Flatten the chunks: token ids, the attention index tensors, and the rows to take logits from."""
        bs = self.block_size
        ids, seats, positions, logit_rows = [], [], [], []
        dec_tok, dec_seats, dec_lens = [], [], []
        pre_tok, pre_slot, pre_seats, pre_spans = [], [], [], []
        qmax = max((len(c.tokens) for c in out.chunks if len(c.tokens) > 1), default=0)
        for c in out.chunks:
            n, t0 = len(c.tokens), len(ids)
            ids.extend(c.tokens)
            if bs is None:
                seats.extend([c.seat] * n)
            else:  # paged: the block holding each position
                seats.extend(c.blocks[p // bs] for p in range(c.start, c.start + n))
            positions.extend(range(c.start, c.start + n))
            keys = c.seat if bs is None else c.blocks  # where the chunk's keys are: its seat or its block table
            if n == 1:
                dec_tok.append(t0)
                dec_seats.append(keys)
                dec_lens.append(c.start + 1)
            else:
                p = len(pre_seats)
                pre_tok.extend(range(t0, t0 + n))
                pre_slot.extend(range(p * qmax, p * qmax + n))
                pre_seats.append(keys)
                pre_spans.append((c.start, n))
            if c.sample:
                logit_rows.append(t0 + n - 1)
        dense = self._dense(dec_tok, dec_seats, pre_spans, qmax, len(ids))
        if self.net.fused is not None and not dense:  # one fused call, each token against its own keys
            return self._tensor(ids), self._tokenwise(seats, positions, out.chunks), self._tensor(logit_rows)
        if bs is None:
            dec, dec_keys = self._decode_part(dec_tok, dec_seats, dec_lens, dense), None
        else:
            dec, dec_keys = self._paged_decode_part(dec_tok, dec_seats, dec_lens)
        pre, pre_keys = self._prefill_part(pre_tok, pre_slot, pre_seats, pre_spans, qmax, dense)
        attn = AttentionPlan(self._tensor(seats), self._tensor(positions), *dec, *pre, dec_keys, pre_keys)
        return self._tensor(ids), attn, self._tensor(logit_rows)

    def _dense(self, dec_tok, dec_seats, pre_spans, qmax, num_tokens) -> bool:
        """A step one dense call per layer serves: decodes only, token i in seat i (slot caches); or whole prompts
        all of one length, which no sliding window cuts."""
        if len(dec_tok) == num_tokens:
            return self.block_size is None and dec_seats == dec_tok
        win = self.net.window
        return not dec_tok and all(s == 0 and n == qmax for s, n in pre_spans) and (win is None or qmax <= win)

    def _tokenwise(self, seats, positions, chunks) -> AttentionPlan:
        """Each token's (sequence, first key, end key): its seat's keys (a slot cache) or its chunk's block table
        (paged: the rows of every chunk's keys in `key_rows`), from the window's start (or 0) to itself."""
        win, bs = self.net.window, self.block_size
        if bs is None:
            seq = seats
        else:
            seq = [i for i, c in enumerate(chunks) for _ in c.tokens]
        spans = [(s, 0 if win is None else max(0, p + 1 - win), p + 1) for s, p in zip(seq, positions)]
        rows = None
        if bs is not None:
            rows = self._keys([c.blocks for c in chunks], -(-(max(positions) + 1) // bs) * bs)
        return AttentionPlan(self._tensor(seats), self._tensor(positions), spans=self._tensor(spans), key_rows=rows)

    def _decode_part(self, tok, seats, lens, dense):
        if not tok:
            return None, None, 0, 0, None, False
        num_seats, length = max(seats) + 1, max(lens)
        seat_len = [1] * num_seats           # seats not decoding attend to position 0 (discarded)
        for s, n in zip(seats, lens):
            seat_len[s] = n
        win = self.net.window
        masked = any(n != length for n in seat_len) or (win is not None and length > win)
        bias = self._bias(seat_len, length) if masked else None
        return self._tensor(tok), self._tensor(seats), num_seats, length, bias, dense

    def _paged_decode_part(self, tok, tables, lens):
        """Each decode reads whole blocks through its table; the keys past its position are masked."""
        if not tok:
            return (None, None, 0, 0, None, False), None
        length = -(-max(lens) // self.block_size) * self.block_size
        return (self._tensor(tok), None, len(tok), length, self._bias(lens, length), False), self._keys(tables, length)

    def _bias(self, lens, length):
        """[S, 1, 1, length] additive mask of one query at position n - 1 per sequence (n = lens[i]) against keys
        [0, length): 0 where it attends (within the window), -inf elsewhere."""
        win = self.net.window
        j, n = torch.arange(length, device=self.device)[None, :], self._tensor(lens)[:, None]
        masked = j >= n if win is None else (j >= n) | (j < n - win)
        bias = torch.zeros(masked.shape, dtype=self.net.dtype, device=self.device).masked_fill_(masked, -torch.inf)
        return bias[:, None, None, :]

    def _prefill_part(self, tok, slot, seats, spans, qmax, dense):
        """The plan's prompt-chunk fields and, paged, the rows of their keys (whole blocks through each chunk's
        table in `seats`)."""
        if not tok:
            return (None, None, None, (0, 0, 0), None, False), None
        length = max(s + n for s, n in spans)
        if self.block_size is not None:
            length = -(-length // self.block_size) * self.block_size
        mask = None if dense else self._mask(spans, qmax, length)
        paged = self.block_size is not None
        where = None if paged else self._tensor(seats)
        part = (self._tensor(tok), self._tensor(slot), where, (len(seats), qmax, length), mask, dense)
        return part, self._keys(seats, length) if paged and not dense else None

    def _mask(self, spans, qmax, length):
        """[P, 1, qmax, length] bool, True where a chunk's query attends: keys up to its absolute position (and
        within the window); padded query rows see all. None when every chunk is a whole prompt and no window cuts
        (plain causal from position 0: SDPA's is_causal, aligned top-left, as the chunks start at key 0)."""
        win = self.net.window if self.net.window is not None and length > self.net.window else None
        if win is None and all(s == 0 for s, _ in spans):
            return None
        starts = self._tensor([s for s, _ in spans])[:, None, None]
        counts = self._tensor([n for _, n in spans])[:, None, None]
        qi = torch.arange(qmax, device=self.device)[None, :, None]
        kj = torch.arange(length, device=self.device)[None, None, :]
        seen = kj <= starts + qi  # causal by absolute position: a chunk after a cached prefix is aligned to its end
        if win is not None:
            seen &= kj > starts + qi - win
        return (seen | (qi >= counts))[:, None]  # padded query rows see all

    def _keys(self, tables, length):
        """Cache rows [B, kv heads, length] of each sequence's first `length` positions (whole blocks) through its
        block table; positions past a table's end read block 0 (masked)."""
        nb = length // self.block_size
        return self.cache.keys(self._tensor([t[:nb] + (0,) * (nb - len(t)) for t in tables]))

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, params: dict, seen: dict | None = None) -> dict[str, int]:
        """One forward pass; returns rid -> sampled token for every chunk that samples. params: rid ->
        SamplingParams; seen: rid -> (prompt ids, output ids) for rows with penalties. Rows whose params ask for
        logprobs leave rid -> (chosen token's logprob, ((id, logprob), ...)) in self.logprobs: the raw model
        distribution (fp32 log-softmax of the logits, before penalties, temperature, top-k and top-p), as vLLM
        and OpenAI report them."""
        ids, attn, rows = self.plan(out)
        logits = self.net.forward(ids, attn, self.cache, rows, self.compile, self.graphs)
        rids = [c.rid for c in out.chunks if c.sample]
        asked = [i for i, r in enumerate(rids) if params[r].logprobs is not None]
        raw = logits[asked].float().log_softmax(dim=-1) if asked else None  # before the sampler edits logits
        tokens = self.sampler(logits, rids, [params[r] for r in rids], seen)
        self.logprobs = dict(zip([rids[i] for i in asked], token_logprobs(
            raw, [tokens[i] for i in asked], [params[rids[i]].logprobs for i in asked]))) if asked else {}
        return dict(zip(rids, tokens))
