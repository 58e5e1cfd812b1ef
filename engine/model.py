"""One forward pass over a flattened, ragged batch of tokens for Llama-family models (Llama, Mistral, Qwen2).

The weights are copies of the Hugging Face model's, stored [in, out] (faster GEMMs on the CPU than [out, in]),
with q/k/v and gate/up fused into one matrix each; on fp32 CPUs with MKL each is also packed once into MKL's GEMM
layout, which saves the per-call repacking of the weight (10-27% faster products at 2-64 rows on AVX-512).
The attention scale is folded into the q rows of the fused matrix (exact when it is a power of two, as for
head_dim 64). Attention runs in two batched calls per layer, never a loop over sequences:
  decodes (one query each) against a no-copy view of the first seats of the cache,
  prompt chunks (padded to the longest chunk) against a gather of their seats.
Steps of decodes only may run through torch.compile (forward's `compiled`).
"""
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2")
ROW_BLOCK = 1024  # tokens per MLP block in long prefills: keeps the [rows, 2 x intermediate] activations in cache


# MKL's packed product as an operator of its own, which a compiled graph calls as is (Inductor's lowering of the
# MKL operator needs a fixed row count); eager code calls the MKL operator directly
_OPS = torch.library.Library("flat", "DEF")
_OPS.define("packed_linear(Tensor x, Tensor packed, Tensor w_out_in, Tensor? bias) -> Tensor")
_OPS.impl("packed_linear", lambda x, packed, w, bias: torch.ops.mkl._mkl_linear(x, packed, w, bias, x.shape[0]),
          "CompositeExplicitAutograd")


@torch.library.register_fake("flat::packed_linear")
def _packed_linear_shape(x, packed, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


class Dense:
    """y = x @ w (+ bias) (+ residual) for a weight w stored [in, out]."""

    def __init__(self, w_in_out: torch.Tensor, bias: torch.Tensor | None = None):
        self.w, self.bias = w_in_out.contiguous(), bias
        mkl = self.w.device.type == "cpu" and self.w.dtype == torch.float32 and torch.backends.mkl.is_available()
        # packed once; the layout does not depend on the row count (64 is only a hint), so any row count may use it
        self.w_out_in = self.w.t()  # a view: the shape MKL's packed product reads its sizes from
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.w_out_in, 64) if mkl else None

    @property
    def shape(self) -> torch.Size:
        return self.w.shape

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: [rows, out], added to the product (inside it where there is no bias and one row)."""
        if self.packed is not None and x.shape[0] > 1:  # one row: MKL's matrix-vector path is faster unpacked
            if torch.compiler.is_compiling():  # eager calls skip the operator's Python body: 1-2% of a B=64 step
                y = torch.ops.flat.packed_linear(x, self.packed, self.w_out_in, self.bias)
            else:
                y = torch.ops.mkl._mkl_linear(x, self.packed, self.w_out_in, self.bias, x.shape[0])
        elif self.bias is None:
            return x @ self.w if residual is None else torch.addmm(residual, x, self.w)
        else:
            y = torch.addmm(self.bias, x, self.w)
        return y if residual is None else y.add_(residual)


@dataclass
class AttentionPlan:
    """Index tensors for one step, shared by every layer; built by the runner."""
    seats: torch.Tensor          # [T] seat of each token
    positions: torch.Tensor      # [T] position of each token in its sequence
    dec_tok: torch.Tensor | None  # [Bd] flat indices of one-token chunks
    dec_seats: torch.Tensor | None
    dec_num_seats: int           # decode view covers seats [0, dec_num_seats)
    dec_len: int                 # decode view length (longest context among decoders)
    dec_bias: torch.Tensor | None  # [S, 1, 1, L] additive: 0 = attend, -inf = masked; None: nothing masked
    dec_dense: bool              # all tokens are decodes and token i sits in seat i
    pre_tok: torch.Tensor | None  # [Tp] flat indices of tokens in multi-token chunks
    pre_slot: torch.Tensor | None  # [Tp] index into the padded [P * Qmax] query grid
    pre_seats: torch.Tensor | None  # [P]
    pre_shape: tuple[int, int, int]  # (P, Qmax, Lp)
    pre_mask: torch.Tensor | None  # [P, 1, Qmax, Lp] bool; None when every chunk starts at 0 (plain causal)
    pre_dense: bool = False      # only whole prompts, all of one length: this step's q, k, v are the grid


_BUILT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Hugging Face model -> its FlatModel


class FlatModel:
    def __init__(self, hf_model):
        cfg = hf_model.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported; the engine runs {SUPPORTED}")
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.act = {"silu": F.silu, "gelu": F.gelu}[cfg.hidden_act]
        m = hf_model.model
        self.embed = m.embed_tokens.weight
        self.norm = m.norm.weight
        self.rotary = m.rotary_emb
        self.layers = []
        with torch.no_grad():
            self.lm_head = Dense(hf_model.lm_head.weight.t())
            for layer in m.layers:
                a, mlp = layer.self_attn, layer.mlp
                bias = None if a.q_proj.bias is None else \
                    torch.cat([a.q_proj.bias * self.scale, a.k_proj.bias, a.v_proj.bias])
                self.layers.append((
                    layer.input_layernorm.weight,
                    Dense(torch.cat([a.q_proj.weight * self.scale, a.k_proj.weight, a.v_proj.weight]).t(), bias),
                    Dense(a.o_proj.weight.t()),
                    layer.post_attention_layernorm.weight,
                    Dense(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).t()),
                    Dense(mlp.down_proj.weight.t()),
                ))
        self._compiled = None  # _forward through torch.compile, made on first use

    @classmethod
    def of(cls, hf_model) -> "FlatModel":
        """The engine's copy of a model's weights, built and packed once per model object (about 1 s here)."""
        if hf_model not in _BUILT:
            _BUILT[hf_model] = cls(hf_model)
        return _BUILT[hf_model]

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.embed.element_size()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, plan: AttentionPlan, cache, logit_rows: torch.Tensor,
                compiled: bool = False) -> torch.Tensor:
        """ids: [T]; returns float32 logits [len(logit_rows), vocab].

        compiled: run a step of decodes only through torch.compile (Inductor, dynamic shapes): one graph per step
        instead of ~70 eager operators per layer, the elementwise ones fused (~10% faster steps at one row here).
        Compiling takes 30-120 s per process for each kind of step (one row; several; several of one length),
        less when Inductor's disk cache has it."""
        if compiled and plan.dec_dense:
            if self._compiled is None:
                self._compiled = torch.compile(self._forward, dynamic=True)
            return self._compiled(ids, plan, cache, logit_rows)
        return self._forward(ids, plan, cache, logit_rows)

    def _forward(self, ids: torch.Tensor, plan: AttentionPlan, cache, logit_rows: torch.Tensor) -> torch.Tensor:
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(ids, self.embed)
        cos, sin = self.rotary(x[None], plan.positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]           # [T, 1, D]
        sin = torch.cat([-sin[..., :D // 2], sin[..., D // 2:]], dim=-1)  # rotate_half(x) * sin = swap(x) * this
        T = ids.shape[0]
        slots = cache.slots(plan.seats, plan.positions)  # flat cache rows of this step's tokens
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            h = F.rms_norm(x, (x.shape[-1],), ln1, self.eps)
            qkv = wqkv(h)
            qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)  # rotary on q and k together
            qk = qk.view(T, H + KV, 2, D // 2).flip(2).view(qk.shape).mul_(sin).addcmul_(qk, cos)  # halves swapped
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
            cache.write(i, slots, k, v)
            attn = self._attend(i, q, k, v, plan, cache)
            x = wo(attn.view(T, H * D), residual=x)
            if T <= ROW_BLOCK:
                x = self._mlp(x, ln2, wgu, wd)
            else:
                x = torch.cat([self._mlp(xb, ln2, wgu, wd) for xb in x.split(ROW_BLOCK)])
        x = F.rms_norm(x[logit_rows], (x.shape[-1],), self.norm, self.eps)
        return self.lm_head(x).float()

    def _mlp(self, x, ln, wgu, wd):
        """x + down(act(gate) * up) of rms_norm(x)."""
        gate, up = wgu(F.rms_norm(x, (x.shape[-1],), ln, self.eps)).chunk(2, dim=-1)
        return wd(self.act(gate) * up, residual=x)

    def _attend(self, layer: int, q, k, v, plan: AttentionPlan, cache) -> torch.Tensor:
        H, D = self.num_heads, self.head_dim
        if plan.pre_dense:  # equal whole prompts: no padding, no gather
            P, Q, _ = plan.pre_shape
            grid = [t.view(P, Q, -1, D).transpose(1, 2) for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*grid, is_causal=True, scale=1.0, enable_gqa=True)
            return o.transpose(1, 2).reshape(q.shape)
        S, L = plan.dec_num_seats, plan.dec_len
        if plan.dec_dense:  # every token is a decode, token i in seat i: no scatter, no gather
            return self._decode(layer, q.contiguous(), S, L, plan.dec_bias, cache).view(q.shape)
        out = torch.empty_like(q)
        if plan.dec_tok is not None:
            qd = q.new_zeros(S, H, D)
            qd[plan.dec_seats] = q[plan.dec_tok]
            out[plan.dec_tok] = self._decode(layer, qd, S, L, plan.dec_bias, cache)[plan.dec_seats]
        if plan.pre_tok is not None:
            P, Q, L = plan.pre_shape
            qp = q.new_zeros(P * Q, H, D)
            qp[plan.pre_slot] = q[plan.pre_tok]
            k, v = cache.gather(layer, plan.pre_seats, L)
            o = F.scaled_dot_product_attention(qp.view(P, Q, H, D).transpose(1, 2), k, v, attn_mask=plan.pre_mask,
                                               is_causal=plan.pre_mask is None, scale=1.0, enable_gqa=True)
            out[plan.pre_tok] = o.transpose(1, 2).reshape(P * Q, H, D)[plan.pre_slot]
        return out

    def _decode(self, layer: int, q: torch.Tensor, S: int, L: int, bias: torch.Tensor | None, cache) -> torch.Tensor:
        """One (scaled) query per seat [S, H, D] against a view of seats [0, S): two batched matmuls over the GQA
        groups."""
        KV, D = self.num_kv_heads, self.head_dim
        k, v = (t.view(S * KV, L, D) for t in cache.view(layer, S, L))  # no copy: seats and heads share a stride
        scores = torch.bmm(q.view(S * KV, -1, D), k.transpose(1, 2))    # [S * KV, H/KV, L]
        if bias is not None:
            scores.view(S, KV, -1, L).add_(bias)
        return torch.bmm(scores.softmax(dim=-1), v).view(S, self.num_heads, D)
