"""The model runner: turns a SchedulerOutput into one forward pass and one sampled token per sampling chunk.

It never branches on the policy: a decode, a whole prompt and a prompt chunk are chunks of different lengths.
Only plain Python values go back to the scheduler.
"""
import torch

from engine.kv_cache import CatCache, SlotCache
from engine.model import AttentionPlan, FlatModel
from engine.sampler import Sampler, token_logprobs
from engine.scheduler import SchedulerOutput

CACHES = {"slot": SlotCache, "cat": CatCache}


class ModelRunner:
    def __init__(self, hf_model, num_seats: int, seat_tokens: int, cache: str = "slot", seed: int = 0, eos_ids=(),
                 compile: bool = False):
        self.net = FlatModel.of(hf_model)
        self.compile = compile  # decode-only steps through torch.compile (FlatModel.forward)
        self.device = self.net.embed.device
        self.seat_tokens = seat_tokens
        self.cache = CACHES[cache](self.net.num_layers, num_seats, seat_tokens, self.net.num_kv_heads,
                                   self.net.head_dim, self.net.dtype, self.device)
        self.sampler = Sampler(seed, eos_ids)
        self.logprobs: dict[str, tuple] = {}  # rid -> (logprob, top alternatives) of the last run's rows that asked

    @property
    def vocab_size(self) -> int:
        return self.net.vocab_size

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def plan(self, out: SchedulerOutput):
        """Flatten the chunks: token ids, the attention index tensors, and the rows to take logits from."""
        ids, seats, positions, logit_rows = [], [], [], []
        dec_tok, dec_seats, dec_lens = [], [], []
        pre_tok, pre_slot, pre_seats, pre_spans = [], [], [], []
        qmax = max((len(c.tokens) for c in out.chunks if len(c.tokens) > 1), default=0)
        for c in out.chunks:
            n, t0 = len(c.tokens), len(ids)
            ids.extend(c.tokens)
            seats.extend([c.seat] * n)
            positions.extend(range(c.start, c.start + n))
            if n == 1:
                dec_tok.append(t0)
                dec_seats.append(c.seat)
                dec_lens.append(c.start + 1)
            else:
                p = len(pre_seats)
                pre_tok.extend(range(t0, t0 + n))
                pre_slot.extend(range(p * qmax, p * qmax + n))
                pre_seats.append(c.seat)
                pre_spans.append((c.start, n))
            if c.sample:
                logit_rows.append(t0 + n - 1)
        dec = self._decode_part(dec_tok, dec_seats, dec_lens, len(ids))
        pre = self._prefill_part(pre_tok, pre_slot, pre_seats, pre_spans, qmax, len(ids))
        attn = AttentionPlan(self._tensor(seats), self._tensor(positions), *dec, *pre)
        return self._tensor(ids), attn, self._tensor(logit_rows)

    def _decode_part(self, tok, seats, lens, num_tokens):
        if not tok:
            return None, None, 0, 0, None, False
        num_seats, length = max(seats) + 1, max(lens)
        dense = len(tok) == num_tokens and seats == tok  # only decodes, token i in seat i
        seat_len = [1] * num_seats           # seats not decoding attend to position 0 (discarded)
        for s, n in zip(seats, lens):
            seat_len[s] = n
        bias, win = None, self.net.window
        if any(n != length for n in seat_len) or (win is not None and length > win):
            j, n = torch.arange(length, device=self.device)[None, :], self._tensor(seat_len)[:, None]
            masked = j >= n if win is None else (j >= n) | (j < n - win)  # the query sits at position n - 1
            bias = torch.zeros(masked.shape, dtype=self.net.dtype, device=self.device).masked_fill_(masked, -torch.inf)
            bias = bias[:, None, None, :]
        return self._tensor(tok), self._tensor(seats), num_seats, length, bias, dense

    def _prefill_part(self, tok, slot, seats, spans, qmax, num_tokens):
        if not tok:
            return None, None, None, (0, 0, 0), None, False
        length = max(s + n for s, n in spans)
        shape = (len(seats), qmax, length)
        win = self.net.window if self.net.window is not None and length > self.net.window else None
        if win is None and all(s == 0 for s, _ in spans):  # whole prompts: causal from 0; padded rows discarded
            dense = len(tok) == num_tokens and all(n == qmax for _, n in spans)
            return self._tensor(tok), self._tensor(slot), self._tensor(seats), shape, None, dense
        starts = self._tensor([s for s, _ in spans])[:, None, None]
        counts = self._tensor([n for _, n in spans])[:, None, None]
        qi = torch.arange(qmax, device=self.device)[None, :, None]
        kj = torch.arange(length, device=self.device)[None, None, :]
        seen = kj <= starts + qi  # causal by absolute position
        if win is not None:
            seen &= kj > starts + qi - win
        mask = seen | (qi >= counts)  # padded query rows see all
        return self._tensor(tok), self._tensor(slot), self._tensor(seats), shape, mask[:, None], False

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, params: dict, seen: dict | None = None) -> dict[str, int]:
        """One forward pass; returns rid -> sampled token for every chunk that samples. params: rid ->
        SamplingParams; seen: rid -> (prompt ids, output ids) for rows with penalties. Rows whose params ask for
        logprobs leave rid -> (chosen token's logprob, ((id, logprob), ...)) in self.logprobs: the raw model
        distribution (fp32 log-softmax of the logits, before penalties, temperature, top-k and top-p), as vLLM
        and OpenAI report them."""
        ids, attn, rows = self.plan(out)
        logits = self.net.forward(ids, attn, self.cache, rows, self.compile)
        rids = [c.rid for c in out.chunks if c.sample]
        asked = [i for i, r in enumerate(rids) if params[r].logprobs is not None]
        raw = logits[asked].float().log_softmax(dim=-1) if asked else None  # before the sampler edits logits
        tokens = self.sampler(logits, rids, [params[r] for r in rids], seen)
        self.logprobs = dict(zip([rids[i] for i in asked], token_logprobs(
            raw, [tokens[i] for i in asked], [params[rids[i]].logprobs for i in asked]))) if asked else {}
        return dict(zip(rids, tokens))
