"""One forward pass over a flattened, ragged batch of tokens for Llama-family models (Llama, Mistral, Qwen2).

The weights are copies of the Hugging Face model's with q/k/v and gate/up fused into one matrix each, held in the
layouts of the products this machine runs fastest at each row count (engine/kernels.py: [in, out], [out, in], or
MKL's or oneDNN's packed layouts on fp32 CPUs, which save the per-call repacking of the weight), measured once per
machine.
The attention scale is folded into the q rows of the fused matrix when that is exact in any dtype (a power of two,
as for head_dim 64 or 16); otherwise (head_dim 128: 2^-3.5) it is applied in the attention, as Hugging Face does.
Attention softmax runs in fp32 whatever the weights' dtype; logits come out in fp32 for the sampler.
Attention runs in at most two batched calls per layer, never a loop over sequences:
  decodes (one query each) against a no-copy view of the first seats of the cache,
  prompt chunks (padded to the longest chunk) against a gather of their seats.
On a paged cache both parts gather each sequence's keys through its block table (plan.dec_keys, plan.pre_keys)
into one contiguous tensor, then run the same two calls. With the fused kernels, a step of decodes in seats
0..n-1 or of whole prompts of one length keeps its dense call; any other step (scattered seats, ragged prompts,
chunks after a cached prefix, decodes beside prompts, a paged cache) runs one call over all its tokens, each reading
its own keys in place (plan.spans), with no padding, gather or scatter.
Steps of decodes only may run through torch.compile (forward's `compiled`).
On fp32 CPUs the norms, rotary, SiLU x up, KV writes and attention (but that of whole prompts of one length) run as
fused kernels (engine/native.py) where they build, ATen's operators otherwise (`fused`).
A config is checked first (engine/support.py): a field whose effect this pass does not compute is refused by name. A
sliding window (Mistral; Qwen2 with every layer windowed) is only a mask: the cache keeps every position.
"""
import math
import weakref
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine import kernels, native
from engine.compiled import CompiledStep
from engine.kernels import Dense
from engine.support import ACTIVATIONS, check_config

ROW_BLOCK = 1024  # tokens per MLP block in long prefills: keeps the [rows, 2 x intermediate] activations in cache
KEY_BUCKET = 128  # keys: decode steps with graphs pad their context to a multiple of this


@dataclass
class AttentionPlan:
    """Index tensors for one step, shared by every layer; built by the runner."""
    seats: torch.Tensor          # [T] seat of each token
    positions: torch.Tensor      # [T] position of each token in its sequence
    dec_tok: torch.Tensor | None = None  # [Bd] flat indices of one-token chunks
    dec_seats: torch.Tensor | None = None
    dec_num_seats: int = 0       # decode view covers seats [0, dec_num_seats)
    dec_len: int = 0             # decode view length (longest context among decoders)
    dec_bias: torch.Tensor | None = None  # [S, 1, 1, L] additive: 0 = attend, -inf = masked; None: nothing masked
    dec_dense: bool = False      # all tokens are decodes and token i sits in seat i
    pre_tok: torch.Tensor | None = None  # [Tp] flat indices of tokens in multi-token chunks
    pre_slot: torch.Tensor | None = None  # [Tp] index into the padded [P * Qmax] query grid
    pre_seats: torch.Tensor | None = None  # [P]
    pre_shape: tuple[int, int, int] = (0, 0, 0)  # (P, Qmax, Lp)
    pre_mask: torch.Tensor | None = None  # [P, 1, Qmax, Lp] bool; None when every chunk starts at 0 (plain causal)
    pre_dense: bool = False      # only whole prompts, all of one length: this step's q, k, v are the grid
    dec_keys: torch.Tensor | None = None  # paged: [Bd, KV, Ld] cache rows of each decode's keys (dec_bias masks)
    pre_keys: torch.Tensor | None = None  # paged: [P, KV, Lp] cache rows of each chunk's keys (pre_shape's Lp)
    spans: torch.Tensor | None = None  # [T, 3] each token's (sequence, first key, end key): the fused kernel's
                                       # attention of a step neither dense part takes (no other field is then set)
    key_rows: torch.Tensor | None = None  # paged, with spans: [sequences, KV, L] cache rows of each sequence's keys


_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Hugging Face model -> its FlatModel


def _fused(projections, scales=None) -> "Dense":
    """One Dense for several nn.Linear side by side (output features concatenated), each scaled; a missing bias
    among biased ones counts as zeros."""
    scales = scales or [1.0] * len(projections)
    w = torch.cat([p.weight if s == 1.0 else p.weight * s for p, s in zip(projections, scales)])
    if all(p.bias is None for p in projections):
        return Dense(w)
    return Dense(w, torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias * s
                               for p, s in zip(projections, scales)]))


def _release(linears) -> None:
    """Free nn.Linear weights (and biases) whose values the engine now holds in its own layout."""
    for lin in linears:
        lin.weight = torch.nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(lin.bias.new_empty(0), requires_grad=False)


def _taken(*args, **kwargs):
    raise RuntimeError("this Hugging Face model gave its weights to the engine (FlatModel.of(model, take=True)); "
                       "load it again to run it")


class FlatModel:
    def __init__(self, hf_model, take: bool = False, kernel: str | None = None, remeasure: bool = False,
                 fused: bool = True):
        """take: the Hugging Face model gives up each layer's weights as soon as the engine holds them in its own
        layout (the weights then exist once, and the peak is one copy plus one layer); it can no longer run.
        kernel: one product for every matrix and row count (a kernels.candidates name); None: each shape's
        measured choice (engine/kernels.py), `remeasure` measuring it again.
        fused: engine/native.py's kernels on an fp32 CPU, where they build (`self.fused`: their ops, else None)."""
        cfg = hf_model.config
        self.window = check_config(hf_model)  # tokens each query attends (itself included); None = all before it
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        scale = self.head_dim ** -0.5
        folded = math.log2(scale).is_integer()  # a power of two: multiplying the weights by it is exact
        self.attn_scale = 1.0 if folded else scale  # what the attention itself still applies
        self.act = ACTIVATIONS[cfg.hidden_act]
        m = hf_model.model
        fp32_cpu = m.embed_tokens.weight.device.type == "cpu" and m.embed_tokens.weight.dtype == torch.float32
        self.fused = native.ops() if fused and fp32_cpu else None
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.rotary = m.rotary_emb
        self.layers = []
        with torch.no_grad():
            self.lm_head = Dense(hf_model.lm_head.weight)
            if take and hf_model.lm_head.weight is not self.embed:
                _release([hf_model.lm_head])
            for layer in m.layers:
                a, mlp = layer.self_attn, layer.mlp
                self.layers.append((
                    layer.input_layernorm.weight,
                    _fused([a.q_proj, a.k_proj, a.v_proj], [scale if folded else 1.0, 1.0, 1.0]),
                    _fused([a.o_proj]),
                    layer.post_attention_layernorm.weight,
                    _fused([mlp.gate_proj, mlp.up_proj]),
                    _fused([mlp.down_proj]),
                ))
                if take:
                    _release([a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
        if take:
            hf_model.forward = _taken
        self.compiled_step = CompiledStep(self._forward)  # decode-only steps through torch.compile (forward)
        self.kernels = self._choose_kernels(kernel, remeasure)  # (in, out) -> {"choice": per bucket, "ms": timings}

    def _choose_kernels(self, kernel: str | None, remeasure: bool) -> dict:
        groups = {}
        for d in [self.lm_head, *(d for layer in self.layers for d in (layer[1], layer[2], layer[4], layer[5]))]:
            groups.setdefault(tuple(d.shape), []).append(d)
        dev, dtype = self.embed.device, self.embed.dtype
        if kernel is not None:
            if kernel not in kernels.candidates(dev, dtype):
                raise ValueError(f"kernel {kernel!r} does not run here; choose from {kernels.candidates(dev, dtype)}")
            chosen = {shape: {"choice": [kernel] * len(kernels.BUCKETS), "ms": None} for shape in groups}
        else:
            with torch.no_grad():
                chosen = kernels.choose(groups, dev, dtype, remeasure)
        for shape, mats in groups.items():
            for d in mats:
                d.kinds = list(chosen[shape]["choice"])
                d.hold(d.kinds)
        return chosen

    @classmethod
    def of(cls, hf_model, take: bool = False) -> "FlatModel":
        """The engine's weights for a model: built once per model object (about 1 s here, plus the kernel
        measurement the first time on a machine), copied from it, or taken from it (`take`, see __init__); a
        FlatModel is returned as it is."""
        if isinstance(hf_model, FlatModel):
            return hf_model
        if hf_model not in _BUILT:
            _BUILT[hf_model] = cls(hf_model, take)
        return _BUILT[hf_model]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the engine holds for the weights (shared ones once; packed copies included)."""
        tensors = [self.embed, self.norm, *self.lm_head.tensors]  # a tied head's [out, in] weight is the embedding
        for ln1, *dense in ((l[0], l[1], l[2], l[4], l[5]) for l in self.layers):
            tensors.append(ln1)
            tensors += [t for d in dense for t in d.tensors]
        tensors += [l[3] for l in self.layers]
        seen = {}
        for t in tensors:
            if t is None:
                continue
            try:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            except NotImplementedError:  # packed weights are opaque: their own size
                seen[id(t)] = t.nbytes
        return sum(seen.values())

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, plan: AttentionPlan, cache, logit_rows: torch.Tensor,
                compiled: bool = False, graphs: bool = False) -> torch.Tensor:
        """ids: [T]; returns float32 logits [len(logit_rows), vocab].

        compiled: run a step of decodes only through torch.compile (Inductor, dynamic shapes): one graph per step
        instead of the eager operators (on 2 AVX-512 cores 0.68-0.84x eager's SmolLM2 decode rate at 1 row and
        0.86-1.00x at 64, eager running the fused kernels: README).
        Each kind of step (one row; several; several of one length; per kernel row bucket) is compiled once per
        process, from Inductor's disk cache when it has the graph (engine/compiled.py; LLMEngine.warm_up compiles
        them all up front); cold, SmolLM2's up to 64 rows took 21 minutes on 2 AVX-512 cores (12 cached). Where
        compiling fails, those steps run eager from then on, the reason logged once and kept in `compiled_step.error`.
        graphs: pad those steps to a few shapes (see _bucketed); with `compiled` on CUDA each shape is captured
        once as a CUDA graph (mode "reduce-overhead") and replayed, so a decode step is one launch."""
        if not (plan.dec_dense and (compiled or graphs)):
            return self._forward(ids, plan, cache, logit_rows)
        n = logit_rows.shape[0]
        if graphs:
            ids, plan, logit_rows = self._bucketed(ids, plan, cache)
        if compiled:
            logits = self.compiled_step(ids, plan, cache, logit_rows, static=lambda: cache.k + cache.v,
                                        cuda_graphs=graphs and self.embed.device.type == "cuda")
        else:
            logits = self._forward(ids, plan, cache, logit_rows)
        return logits[:n].clone() if graphs else logits  # a graph's outputs are overwritten by its next replay

    def _bucketed(self, ids: torch.Tensor, plan: AttentionPlan, cache):
        """A dense decode step padded to one of few shapes: seats to the next power of two (at most the cache's),
        keys to the next multiple of KEY_BUCKET (at most a seat), each row masked to its own keys. A padded row
        decodes token 0 in its own seat at the seat's last position, which no request ever writes (prompt +
        max_tokens fit the seat and the last token is never fed back), and attends every key; its logits are
        dropped. Returns ids, plan, logit rows (all rows, in seat order)."""
        S, dev = plan.dec_num_seats, ids.device
        Sb = min(1 << (S - 1).bit_length(), cache.k[0].shape[0])
        Lb = min(-(-plan.dec_len // KEY_BUCKET) * KEY_BUCKET, cache.seat_tokens)
        rows = torch.arange(Sb, device=dev)
        pos = torch.cat([plan.positions, plan.positions.new_full((Sb - S,), cache.seat_tokens - 1)])
        j, p = torch.arange(Lb, device=dev)[None, :], pos[:, None]
        masked = j > p if self.window is None else (j > p) | (j <= p - self.window)
        masked &= (rows < S)[:, None]  # padded rows see every key: no row is all -inf (no NaN written anywhere)
        bias = torch.zeros(masked.shape, dtype=self.dtype, device=dev).masked_fill_(masked, -torch.inf)
        plan = replace(plan, seats=rows, positions=pos, dec_num_seats=Sb, dec_len=Lb, dec_bias=bias[:, None, None, :])
        return torch.cat([ids, ids.new_zeros(Sb - S)]), plan, rows

    def _forward(self, ids: torch.Tensor, plan: AttentionPlan, cache, logit_rows: torch.Tensor) -> torch.Tensor:
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x[None], plan.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]           # [T, 1, D]
        sin = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], dim=-1)  # rotate_half(x) * sin = swap(x) * this
        T = ids.shape[0]
        slots = cache.slots(plan.seats, plan.positions)  # flat cache rows of this step's tokens
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            qkv = wqkv(self._norm(x, ln1))
            qk = self._rotary(qkv[:, :(H + KV) * D].view(T, H + KV, D), cos, sin)  # q and k together
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
            cache.write(i, slots, k, v, self.fused)
            attn = self._attend(i, q, k, v, plan, cache)
            x = wo(attn.reshape(T, H * D), residual=x)  # a view on real devices (attn is contiguous)
            if T <= ROW_BLOCK:
                x = self._mlp(x, ln2, wgu, wd)
            else:
                x = torch.cat([self._mlp(xb, ln2, wgu, wd) for xb in x.split(ROW_BLOCK)])
        return self.lm_head(self._norm(x[logit_rows], self.norm)).float()

    def _norm(self, x, w):
        if self.fused is not None:
            return self.fused.rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rotary(self, qk, cos, sin):
        """qk [T, heads, D]: x * cos + x with its halves swapped * sin (cos, sin [T, 1, D]; sin's first half
        negated); in place on the fused kernel's path."""
        if self.fused is not None:
            self.fused.rotary_(qk, cos[:, 0], sin[:, 0])
            return qk
        T, heads, D = qk.shape
        return qk.view(T, heads, 2, D // 2).flip(2).view(qk.shape).mul_(sin).addcmul_(qk, cos)

    def _mlp(self, x, ln, wgu, wd):
        """x + down(act(gate) * up) of rms_norm(x)."""
        gu = wgu(self._norm(x, ln))
        if self.fused is not None and self.act is F.silu:
            return wd(self.fused.silu_mul(gu), residual=x)
        gate, up = gu.chunk(2, dim=-1)
        return wd(self.act(gate) * up, residual=x)

    def _attend(self, layer: int, q, k, v, plan: AttentionPlan, cache) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        if plan.pre_dense:  # equal whole prompts: no padding, no gather
            P, Q, _ = plan.pre_shape
            grid = [t.view(P, Q, -1, D).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*grid, is_causal=True, scale=self.attn_scale, enable_gqa=True)
            return o.transpose(1, 2).reshape(q.shape)
        if plan.spans is not None:  # every token against its own keys, read in place (fused kernels only)
            return self.fused.token_attention(q, cache.k[layer], cache.v[layer], plan.spans, plan.key_rows,
                                              self.attn_scale)
        S, L = plan.dec_num_seats, plan.dec_len
        if plan.dec_dense:  # every token is a decode, token i in seat i: no scatter, no gather
            return self._decode(q, *cache.view(layer, S, L), plan.dec_bias).view(q.shape)
        out = torch.empty_like(q)
        if plan.dec_keys is not None:  # paged: decode i against its own gathered keys
            out[plan.dec_tok] = self._decode(q[plan.dec_tok], *cache.gather(layer, plan.dec_keys), plan.dec_bias)
        elif plan.dec_tok is not None:
            qd = q.new_zeros(S, H, D)
            qd[plan.dec_seats] = q[plan.dec_tok]
            out[plan.dec_tok] = self._decode(qd, *cache.view(layer, S, L), plan.dec_bias)[plan.dec_seats]
        if plan.pre_tok is not None:
            P, Q, L = plan.pre_shape
            qp = q.new_zeros(P * Q, H, D)
            qp[plan.pre_slot] = q[plan.pre_tok]
            if plan.pre_keys is None:
                k, v = cache.gather(layer, plan.pre_seats, L)
            else:  # paged
                k, v = cache.gather(layer, plan.pre_keys)
            o = F.scaled_dot_product_attention(qp.view(P, Q, H, D).transpose(1, 2), k, v, attn_mask=plan.pre_mask,
                                               is_causal=plan.pre_mask is None, scale=self.attn_scale,
                                               enable_gqa=True)
            out[plan.pre_tok] = o.transpose(1, 2).reshape(P * Q, H, D)[plan.pre_slot]
        return out

    def _decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """One query per sequence [S, H, D] against its keys k, v [S, KV, L, D] (sequences and heads sharing a
        stride: a view of the first seats, or a gather): two batched matmuls over the GQA groups, the softmax in
        fp32 (one fused kernel on the native path, which never reads masked keys)."""
        S, KV, L, D = k.shape
        if self.fused is not None:  # q may be strided (a view of the fused projection)
            return self.fused.decode_attention(q, k, v, None if bias is None else bias.view(S, L), self.attn_scale)
        k, v = k.view(S * KV, L, D), v.view(S * KV, L, D)  # no copy
        scores = torch.bmm(q.contiguous().view(S * KV, -1, D), k.transpose(1, 2))    # [S * KV, H/KV, L]
        if self.attn_scale != 1.0:
            scores.mul_(self.attn_scale)
        if bias is not None:
            scores.view(S, KV, -1, L).add_(bias)
        return torch.bmm(scores.softmax(dim=-1, dtype=torch.float32).to(v.dtype), v).view(S, self.num_heads, D)
