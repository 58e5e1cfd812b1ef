"""One forward pass over a flattened, ragged batch of tokens: FlatModel, the decoder every architecture of
engine/model/models/ is (a family is a subclass there: what its config means, its norms and scales).

FlatModel holds the layers engine/model/weights.py builds from a Hugging Face model (their products in
engine/model/layers/linear.py's storages). Each layer's attention is the step's path from
engine/model/layers/attention.py (softmax in fp32 whatever the weights' dtype); logits come out in fp32 for the
sampler. The native kernels (`ops`, engine/kernels/build.py; None: ATen's operators) are given when the model is built
(engine/factory.py), and each layer piece (norm, rotary, MLP) picks its implementation then. A step of decodes or of
token spans runs every layer in one native call (lab.layers, `one_call`) where each product is one it calls and the
layer is the plain one it computes (no q/k or output norms, SiLU); the Python layer loop otherwise. A step may run
through torch.compile (`compiled`), which traces the Python loop. A sliding window is only a mask: the cache keeps
every position.
"""
import torch
import torch.nn.functional as F

from engine.kernels.choice import bucket
from engine.model import support
from engine.model.compiled import CompiledStep
from engine.model.kv_cache import CatCache
from engine.model.layers.attention import DenseDecode, Spans, StepInputs
from engine.model.layers.mlp import gated_mlp
from engine.model.layers.rotary import Rotary
from engine.model.weights import build_layers, choose_kernels, held_bytes, scales
from engine.specs import PrecisionSpec

KV_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # engine.specs' kv_dtype
HEAD_SPAN = "lab::lm_head"  # the LM head's product, as torch.profiler names it (probe_hardware's step split)
MLP_ROWS = 1024  # tokens per MLP pass in long prefills: keeps the [rows, 2 x intermediate] activations in cache


class FlatModel(support.Architecture):
    def __init__(self, hf_model, ops=None, precision: PrecisionSpec = PrecisionSpec(), gguf=None, take: bool = False):
        """Built by engine/factory.py. ops: the native kernels or None; precision: the level's storage (`weights`:
        "model", "bf16" or "gguf", the blocks of the GGUF file `gguf`; with bf16 or gguf weights the activations,
        norms and softmax stay fp32) and KV dtype (None: the activations'), read back in the activations' dtype;
        take: the Hugging Face model gives up its weights to the engine (engine/model/weights.py) and cannot run
        afterwards. Each product runs the kernel `choose_kernels` gives it (the factory's next step)."""
        cfg, m = hf_model.config, hf_model.model
        self.precision, self.weights = precision, precision.weights
        self.generation_config = hf_model.generation_config  # its end-of-sequence ids (engine.model.loader.eos_ids)
        self.windows = self.layer_windows(cfg)  # each layer's tokens a query attends (itself included); None = all
        self.window = self.windows[0] if len(set(self.windows)) == 1 else None  # the one all layers share, if any
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.act = self.activation(cfg)
        self.device = m.embed_tokens.weight.device
        self.dtype = m.embed_tokens.weight.dtype if self.weights == "model" else torch.float32  # activations
        if precision.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {precision.kv_dtype!r}: choose one of {[k for k in KV_DTYPES if k]}")
        self.kv_dtype = KV_DTYPES[precision.kv_dtype] or self.dtype
        if self.weights == "gguf" and ops is None:
            raise ValueError("GGUF weights need the native CPU kernels (fp32 on a CPU), not built here")
        like = torch.empty(0, dtype=self.dtype, device=self.device)  # the rotary module reads its dtype and device
        self.rotary = Rotary(m.rotary_emb, self.rope_keys(cfg), self.head_dim, like)
        self.embed = m.embed_tokens.weight if self.weights != "gguf" else None  # gguf: the head's rows
        self.embed_scale = self.embedding_scale(cfg, self.dtype)
        self.norm = self.norm_weight(m.norm)
        # attn_scale: what the attention still applies (a q norm after the product would undo a folded factor)
        q_scale, self.attn_scale = scales(self.attention_scale(cfg, self.head_dim), self.weights,
                                          foldable=not self.qk_norms)
        self.ops = ops  # the storages below keep their own
        self.lm_head, self.layers = build_layers(self, hf_model, q_scale, gguf, take)
        self.compiled_step = CompiledStep(self._traced)  # steps through torch.compile (forward's `compiled`)
        self._lab_layers: dict[int, tuple | None] = {}  # row bucket -> lab.layers' weights and kinds, or None
        self.kernels: dict = {}  # (in, out[, family]) -> {"choice": per bucket, "ms": timings}: choose_kernels'
        self.use_ops(ops)

    def use_ops(self, ops) -> None:
        """Each layer piece (norm, MLP, rotary) takes its implementation: the native kernels `ops`, or ATen's (None);
        the products keep their storages' kernels."""
        self.ops = ops
        self.norm_fn = self.make_norm(ops, self.eps)  # norm(x, w)
        self.mlp = gated_mlp(self.act, ops, self.norm_fn)
        self.rotary.use_ops(ops)
        self.one_call = ops is not None and self.act is F.silu and not any(
            layer.qk_norm is not None or layer.attn_out_norm is not None or layer.mlp_out_norm is not None
            for layer in self.layers)  # lab.layers computes this layer
        self._lab_layers.clear()

    def choose_kernels(self, kernel: str | None = None, remeasure: bool = False) -> dict:
        """Give every product its kernel per row bucket: `kernel` for all (a choice.candidates name; the model's own
        weights only), else each shape's measured choice (engine/kernels/choice.py), `remeasure` measuring again."""
        self.kernels = choose_kernels(self.products, kernel if self.weights == "model" else None, remeasure,
                                      self.device, self.dtype)
        self._lab_layers.clear()
        return self.kernels

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
        """How the products compute on this machine (engine/model/layers/linear.py)."""
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
        cos, sin = self.rotary.tables(inputs.positions, inputs.end, traced)  # [T, D x tables]
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
        norm, ropes = self.norm_fn, self.rotary.per_layer(cos, sin)
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(norm(x, layer.input_norm))
            qk = qkv[:, :(H + KV) * D].view(T, H + KV, D)  # q and k together
            if layer.qk_norm is not None:
                qk = norm(qk, layer.qk_norm)
            qk = self.rotary.apply(qk, *ropes[i])
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
            cache.write(i, rows if pool_rows is None else pool_rows[self.windows[i]], k, v, self.ops)
            attn = inputs.attention.attend(self, i, q, k, v, cache).reshape(T, H * D)  # a view on real devices
            if layer.attn_out_norm is None:
                x = layer.o(attn, residual=x)
            else:
                x = x + norm(layer.o(attn), layer.attn_out_norm)
            if T <= MLP_ROWS:
                x = self.mlp(x, layer)
            else:
                x = torch.cat([self.mlp(xb, layer) for xb in x.split(MLP_ROWS)])
        return self._head(x[inputs.logit_rows], traced)

    def _head(self, x, traced: bool = False) -> torch.Tensor:
        """fp32 logits of the final norm of x; the head's product a span torch.profiler names (HEAD_SPAN), but in a
        traced step."""
        x = self.norm_fn(x, self.norm)
        if traced:
            return self.lm_head(x).float()
        with torch.profiler.record_function(HEAD_SPAN):
            return self.lm_head(x).float()

    def _lab_args(self, rows: int, attention) -> tuple | None:
        """Every layer's weights (engine/model/weights.py's LAYER_WEIGHTS each) and product kinds, one after another,
        for lab.layers at this row count, or None where the Python loop runs: not `one_call`, attention other than
        DenseDecode or Spans, more rows than MLP_ROWS, or a product lab.layers does not call."""
        if not self.one_call or rows > MLP_ROWS or not isinstance(attention, (DenseDecode, Spans)):
            return None
        b = bucket(rows)
        if b not in self._lab_layers:
            parts = [layer.lab_args(b) for layer in self.layers]
            self._lab_layers[b] = None if None in parts else (
                [t for weights, _ in parts for t in weights], [k for _, kinds in parts for k in kinds])
        return self._lab_layers[b]
