"""One forward pass over a flattened, ragged batch of tokens for Llama-family models (Llama, Mistral, Qwen2) and
Gemma 3 (gemma3_text).

FlatModel holds the layers engine/model/weights.py builds from a Hugging Face model (their products in
engine/model/linear.py's storages). Each layer's attention is the step's path from engine/model/attention.py (softmax
in fp32 whatever the weights' dtype); logits come out in fp32 for the sampler. On fp32 CPUs the norms, rotary,
SiLU x up, KV writes and attention (but that of whole prompts of one length) run as native kernels
(engine/kernels/build.py) where they build, ATen's operators otherwise (`ops`); a step of decodes or of token spans
runs every layer in one native call (lab.layers) where each product is one it calls, the Python layer loop
otherwise. A step may run through torch.compile (`compiled`), which traces the Python loop.
A config is checked first (engine/model/support.py): a field whose effect this pass does not compute is refused by
name. A sliding window (Mistral; Qwen2 with every layer windowed; Gemma 3's sliding layers) is only a mask: the
cache keeps every position.
Gemma 3 runs the Python layer loop (with the native products, rotary and attention): its norms (1 + w, computed in
fp32 as Hugging Face does, on the hidden state, on each q and k head, and on the attention's and the MLP's outputs
before their residuals), GeGLU and per-layer rotary tables are not what lab.layers computes.
"""
import torch
import torch.nn.functional as F

from engine.kernels import build
from engine.kernels.choice import bucket
from engine.model.attention import DenseDecode, Spans, StepInputs
from engine.model.compiled import CompiledStep
from engine.model.kv_cache import CatCache
from engine.model.support import (
    GEMMA,
    activation,
    attention_scale,
    check_supported,
    embed_scale,
    layer_windows,
    rope_keys,
)
from engine.model.weights import WEIGHTS, build_layers, choose_kernels, held_bytes, scales

KV_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # conf/precision: `kv_dtype`
HEAD_SPAN = "lab::lm_head"  # the LM head's product, as torch.profiler names it (probe_hardware's step split)
MLP_ROWS = 1024  # tokens per MLP pass in long prefills: keeps the [rows, 2 x intermediate] activations in cache


class FlatModel:
    def __init__(self, hf_model, take: bool = False, kernel: str | None = None, remeasure: bool = False,
                 native_kernels: bool = True, weights: str = "model", gguf=None, kv_dtype: str | None = None):
        """take: the Hugging Face model gives up its weights to the engine (engine/model/weights.py); it cannot run
        afterwards. kernel: one product for every matrix and row count (a choice.candidates name); None: each
        shape's measured choice (engine/kernels/choice.py), `remeasure` measuring it again. native_kernels:
        engine/kernels/build.py's kernels on an fp32 CPU, where they build (`self.ops`: their ops, else None).
        weights (a precision level's storage): "model", "bf16" or "gguf", the blocks of the GGUF file `gguf`; with
        bf16 or gguf weights the activations, norms and softmax stay fp32. kv_dtype: the KV cache's ("float32" or
        "bfloat16"; None: the activations' dtype), read back in the activations' dtype."""
        check_supported(hf_model)
        cfg, m = hf_model.config, hf_model.model
        self.generation_config = hf_model.generation_config  # its end-of-sequence ids (engine.loader.eos_ids)
        self.gemma = cfg.model_type in GEMMA
        self.windows = layer_windows(cfg)  # each layer's tokens a query attends (itself included); None = all before it
        self.window = self.windows[0] if len(set(self.windows)) == 1 else None  # the one all layers share, if any
        keys = rope_keys(cfg)
        self.rope_keys = list(dict.fromkeys(keys))  # the rotary tables a step computes (Gemma 3: per layer type)
        self.rope_index = [self.rope_keys.index(k) for k in keys]  # each layer's table
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.act = activation(cfg)
        if weights not in WEIGHTS:
            raise ValueError(f"weights {weights!r}: choose one of {WEIGHTS}")
        self.weights, self.device = weights, m.embed_tokens.weight.device
        self.dtype = m.embed_tokens.weight.dtype if weights == "model" else torch.float32  # activations
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {[k for k in KV_DTYPES if k]}")
        self.kv_dtype = KV_DTYPES[kv_dtype] or self.dtype
        fp32_cpu = self.device.type == "cpu" and self.dtype == torch.float32
        self.ops = build.ops() if native_kernels and fp32_cpu else None
        if weights == "gguf" and self.ops is None:
            raise ValueError(f"GGUF weights need the native CPU kernels (fp32 on a CPU): {build.error}")
        # attn_scale: what the attention still applies (Gemma 3's q norm follows the product: nothing folded)
        q_scale, self.attn_scale = scales(attention_scale(cfg, self.head_dim), weights, foldable=not self.gemma)
        self.embed = m.embed_tokens.weight if weights != "gguf" else None  # gguf: the head's rows (lm_head.rows)
        self.embed_scale = embed_scale(cfg, self.dtype)  # Gemma 3: sqrt(hidden) in the activations' dtype
        self.norm = (1.0 + m.norm.weight.float()) if self.gemma else m.norm.weight.to(self.dtype)
        self.rotary = m.rotary_emb
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions [0, 2^k) (_rope)
        self.lm_head, self.layers = build_layers(hf_model, weights, self.dtype, self.ops, q_scale, gguf, take)
        self.compiled_step = CompiledStep(self._traced)  # steps through torch.compile (forward's `compiled`)
        self._lab_layers: dict[int, tuple | None] = {}  # row bucket -> lab.layers' weights and kinds, or None
        # (in, out) -> {"choice": per bucket, "ms": timings}: fp32's products, GGUF's and bf16's kernels
        self.kernels = choose_kernels(self.products, kernel if weights == "model" else None, remeasure, self.device,
                                      self.dtype)

    @property
    def products(self) -> list:
        """Every matrix product of a step: the LM head, then each layer's qkv, o, gate/up and down."""
        return [self.lm_head, *(d for layer in self.layers for d in layer.products)]

    def pin_kernels(self, bucket: int) -> None:
        """Every product runs, at any row count, the kernel chosen for row bucket `bucket` (accuracy checks: the
        arithmetic decode steps run, measured on long teacher-forced passes)."""
        for d in self.products:
            d.products = [d.products[bucket]] * len(d.products)
        self._lab_layers.clear()

    @property
    def step_bytes(self) -> int:
        """Bytes of weights one step reads: every product's weight once, in the layout it multiplies."""
        return sum(d.weight_bytes for d in self.products)

    @property
    def arithmetic(self) -> list[str]:
        """How the products compute on this machine (engine/model/linear.py)."""
        return sorted({d.arithmetic for d in self.products})

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the engine holds for the weights (shared ones once; packed copies included)."""
        tensors = [self.embed, self.norm, *self.lm_head.tensors]  # a tied head's [out, in] weight is the embedding
        for layer in self.layers:
            tensors += [*layer.norms, *(t for d in layer.products for t in d.tensors)]
        return held_bytes(tensors)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache, compiled: bool = False, cuda_graphs: bool = False) -> torch.Tensor:
        """float32 logits [len(inputs.logit_rows), vocab]. compiled: through torch.compile, each step shape compiled
        once per process (engine/model/compiled.py), eager where compiling fails; cuda_graphs: each compiled shape
        captured once as a CUDA graph and replayed (the cache's tensors kept at their addresses)."""
        if compiled:
            return self.compiled_step(inputs, cache, static=lambda: cache.k + cache.v, cuda_graphs=cuda_graphs)
        return self._forward(inputs, cache)

    def _traced(self, inputs: StepInputs, cache) -> torch.Tensor:
        """The step torch.compile traces: the Python layer loop (the compiler fuses what lab.layers would)."""
        return self._forward(inputs, cache, traced=True)

    def _forward(self, inputs: StepInputs, cache, traced: bool = False) -> torch.Tensor:
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(inputs.ids, self.embed) if self.embed is not None else self.lm_head.rows(inputs.ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        cos, sin = self._rope(inputs.positions, inputs.end, traced=traced)  # [T, D x tables]
        T = inputs.ids.shape[0]
        if inputs.pools is None:
            rows, pool_rows = cache.rows(inputs.places, inputs.positions), None  # flat cache rows of the step's tokens
        else:  # LayerPools: each window's pool's rows
            rows, pool_rows = None, {w: cache.rows(p, inputs.positions) for w, p in inputs.pools.items()}
        args = self._lab_args(T, inputs.attention) \
            if not traced and not isinstance(cache, CatCache) and inputs.pools is None else None
        if args is not None:  # every layer in one call (not on the cat cache, which grows in write)
            a = inputs.attention
            spans, keys = (a.spans, a.key_rows) if isinstance(a, Spans) else (None, None)
            seats, length, bias = (a.num_seats, a.length, a.bias) if isinstance(a, DenseDecode) else (0, 0, None)
            x = self.ops.layers(x, *args, cos, sin, cache.k, cache.v, rows, spans, keys, bias, seats, length, H,
                                self.eps, self.attn_scale)
            return self._head(x[inputs.logit_rows])
        ropes = [(cos, sin)] if len(self.rope_keys) == 1 else \
            [(c.contiguous(), s.contiguous()) for c, s in zip(cos.split(D, -1), sin.split(D, -1))]
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.input_norm))
            qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)  # q and k together
            if layer.qk_norm is not None:
                qk = self._norm(qk, layer.qk_norm)
            qk = self._rotary(qk, *ropes[self.rope_index[i]])
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
            cache.write(i, rows if pool_rows is None else pool_rows[self.windows[i]], k, v, self.ops)
            attn = inputs.attention.attend(self, i, q, k, v, cache).reshape(T, H * D)  # a view on real devices
            if layer.attn_out_norm is None:
                x = layer.o(attn, residual=x)
            else:
                x = x + self._norm(layer.o(attn), layer.attn_out_norm)
            if T <= MLP_ROWS:
                x = self._mlp(x, layer)
            else:
                x = torch.cat([self._mlp(xb, layer) for xb in x.split(MLP_ROWS)])
        return self._head(x[inputs.logit_rows], traced)

    def _head(self, x, traced: bool = False) -> torch.Tensor:
        """fp32 logits of the final norm of x; the head's product a span torch.profiler names (HEAD_SPAN), but in a
        traced step."""
        x = self._norm(x, self.norm)
        if traced:
            return self.lm_head(x).float()
        with torch.profiler.record_function(HEAD_SPAN):
            return self.lm_head(x).float()

    def _lab_args(self, rows: int, attention) -> tuple | None:
        """Every layer's weights and product kinds, one after another, for lab.layers at this row count, or None where
        the Python loop runs: no native kernels, Gemma 3, another activation than SiLU, attention other than
        DenseDecode or Spans, more rows than MLP_ROWS, or a product lab.layers does not call."""
        if self.ops is None or self.gemma or self.act is not F.silu or rows > MLP_ROWS \
                or not isinstance(attention, (DenseDecode, Spans)):
            return None
        b = bucket(rows)
        if b not in self._lab_layers:
            weights, kinds = [], []
            for layer in self.layers:
                parts = [d.lab_args(b) for d in layer.products]
                if None in parts:
                    self._lab_layers[b] = None
                    break
                weights += [layer.input_norm, layer.post_norm, *(t for kind, *ts in parts for t in ts)]
                kinds += [kind for kind, *_ in parts]
            else:
                self._lab_layers[b] = (weights, kinds)
        return self._lab_layers[b]

    def _norm(self, x, w):
        """RMS norm over the last dim, times w: (x * rsqrt(mean(x^2) + eps)) * w. Gemma 3: in fp32 (x widened,
        normalized, times w = 1 + its weight, then cast back, as Hugging Face does), w [heads, D] for x [T, heads, D]
        on q and k: the norm, then a product by w."""
        if self.gemma and x.dtype != torch.float32:  # Gemma 3 in bf16 (a GPU level)
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(x.dtype)
        if w.dim() > 1:
            return F.rms_norm(x, (x.shape[-1],), None, self.eps) * w
        if self.ops is not None:
            return self.ops.rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, positions: torch.Tensor, end: int, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D x tables] of each position (all below `end`), one [T, D] block per rotary table
        (rope_keys), sin's first half negated (rotate_half(x) * sin = swap(x) * this): rows of a table the model's
        rotary module computed once for positions [0, 2^k) (its frequencies are fixed: engine/model/support.py),
        grown when a step reaches past it; a traced step
        computes its own (no table that grows under torch.compile)."""
        if traced:
            return self._rope_rows(positions)
        if self._rope_table is None or self._rope_table[0].shape[0] < end:
            self._rope_table = self._rope_rows(torch.arange(1 << (end - 1).bit_length(), device=self.device))
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D, x = self.head_dim, self.norm.to(self.dtype)  # x gives the rotary module only the dtype and device
        tables = [self.rotary(x, positions[None], *([] if key is None else [key])) for key in self.rope_keys]
        return (torch.cat([cos[0] for cos, _ in tables], dim=-1),
                torch.cat([t for _, sin in tables for t in (-sin[0, :, :D // 2], sin[0, :, D // 2:])], dim=-1))

    def _rotary(self, qk, cos, sin):
        """qk [T, heads, D]: x * cos + x with its halves swapped * sin (cos, sin [T, D]; sin's first half negated); in
        place on the native kernel's path."""
        if self.ops is not None:
            self.ops.rotary_(qk, cos, sin)
            return qk
        T, heads, D = qk.shape
        return qk.view(T, heads, 2, D // 2).flip(2).view(qk.shape).mul_(sin[:, None]).addcmul_(qk, cos[:, None])

    def _mlp(self, x, layer):
        """x + down(act(gate) * up) of rms_norm(x) (Gemma 3: x + rms_norm(down(...)))."""
        gu = layer.gate_up(self._norm(x, layer.post_norm))
        if self.ops is not None and self.act is F.silu:
            return layer.down(self.ops.silu_mul(gu), residual=x)
        gate, up = gu.chunk(2, dim=-1)
        if layer.mlp_out_norm is not None:
            return x + self._norm(layer.down(self.act(gate) * up), layer.mlp_out_norm)
        return layer.down(self.act(gate) * up, residual=x)
