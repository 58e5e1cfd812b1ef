"""One forward pass over a flattened, ragged batch of tokens for Llama-family models (Llama, Mistral, Qwen2).

The weights are copies of the Hugging Face model's with q/k/v and gate/up fused into one matrix each, held in the
layouts of the products engine/kernels/choice.py chose for each row count, measured once per machine ([in, out], [out, in],
or MKL's or oneDNN's packed layouts on fp32 CPUs, which save repacking the weight on every call).
The attention scale is folded into the q rows of the fused matrix when that is exact in any dtype (a power of two,
as for head_dim 64 or 16); otherwise (head_dim 128: 2^-3.5) the attention applies it, as Hugging Face does.
Each layer's attention is the step's path from engine/model/attention.py (softmax in fp32 whatever the weights' dtype);
logits come out in fp32 for the sampler.
Steps of decodes only may run through torch.compile (forward's `compiled`).
On fp32 CPUs the norms, rotary, SiLU x up, KV writes and attention (but that of whole prompts of one length) run as
fused kernels (engine/kernels/build.py) where they build, ATen's operators otherwise (`fused`).
A config is checked first (engine/model/support.py): a field whose effect this pass does not compute is refused by name. A
sliding window (Mistral; Qwen2 with every layer windowed) is only a mask: the cache keeps every position.
"""
import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from engine import threads
from engine.kernels import build as native
from engine.kernels import choice as kernels
from engine.kernels.choice import Dense
from engine.model.attention import DenseDecode, Spans, StepInputs
from engine.model.compiled import CompiledStep
from engine.model.kv_cache import CatCache
from engine.model.quantized import Bf16Dense, GgufDense, gguf_layers
from engine.model.support import ACTIVATIONS, check_config

WEIGHTS = ("model", "bf16", "gguf")  # how the engine stores the weights (conf/precision: `weights`)
KV_DTYPES = {None: None, "float32": torch.float32, "bfloat16": torch.bfloat16}  # conf/precision: `kv_dtype`
ROW_BLOCK = 1024  # tokens per MLP block in long prefills: keeps the [rows, 2 x intermediate] activations in cache
KEY_BUCKET = 128  # keys: decode steps with graphs pad their context to a multiple of this



def native_product(d, bucket: int) -> tuple | None:
    """(kind, weight, aux, bias) of the product a Dense or GgufDense runs at a row bucket, as lab.layers takes it;
    None for one lab.layers does not call."""
    if isinstance(d, GgufDense):
        return native.PRODUCTS.index(d.fmt), d.packed, None, d.bias
    if isinstance(d, Bf16Dense):
        return (native.PRODUCTS.index("bf16"), d.w, d.n, d.bias) if d.native else None
    if not isinstance(d, Dense):
        return None
    name = d.products[bucket]
    weight = {"in_out": d.w, "linear": d.w_out_in, "packed": d.packed, "onednn": d.dnn}[name]
    return native.PRODUCTS.index(name), weight, d.size if name == "packed" else None, d.bias


def _bias(projections, scales=None) -> torch.Tensor | None:
    """The biases of nn.Linear side by side (output features concatenated), each scaled; a missing bias among
    biased ones counts as zeros; None when none has one."""
    scales = scales or [1.0] * len(projections)
    if all(p.bias is None for p in projections):
        return None
    return torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias * s
                      for p, s in zip(projections, scales)])


def _fused(make, projections, scales=None):
    """One product (`make`: Dense or Bf16Dense) for several nn.Linear side by side, each scaled."""
    scales = scales or [1.0] * len(projections)
    w = torch.cat([p.weight if s == 1.0 else p.weight * s for p, s in zip(projections, scales)])
    return make(w, _bias(projections, scales))


def _release(linears) -> None:
    """Free nn.Linear weights (and biases) whose values the engine holds in its own layout."""
    for lin in linears:
        lin.weight = torch.nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(lin.bias.new_empty(0), requires_grad=False)


def _taken(*args, **kwargs):
    raise RuntimeError("this Hugging Face model gave its weights to the engine (FlatModel(model, take=True)); "
                       "load it again to run it")


class FlatModel:
    def __init__(self, hf_model, take: bool = False, kernel: str | None = None, remeasure: bool = False,
                 fused: bool = True, weights: str = "model", gguf=None, kv_dtype: str | None = None):
        """take: the Hugging Face model gives up each layer's weights as soon as the engine holds them in its own
        layout (the weights then exist once); it cannot run afterwards. kernel: one product for every matrix and
        row count (a kernels.candidates name); None: each shape's measured choice (engine/kernels/choice.py), `remeasure`
        measuring it again. fused: engine/kernels/build.py's kernels on an fp32 CPU, where they build (`self.fused`:
        their ops, else None). weights (a precision level's storage): "model" as the Hugging Face model holds
        them; "bf16"; "gguf", the blocks of the GGUF file `gguf` as stored (engine/model/quantized.py). With bf16 or
        gguf weights the activations, norms and softmax stay fp32. kv_dtype: the KV cache's ("float32" or
        "bfloat16"; None: the activations' dtype), read back in the activations' dtype."""
        cfg = hf_model.config
        self.generation_config = hf_model.generation_config  # its end-of-sequence ids (engine.loader.eos_ids)
        self.window = check_config(hf_model)  # tokens each query attends (itself included); None = all before it
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.act = ACTIVATIONS[cfg.hidden_act]
        m = hf_model.model
        if weights not in WEIGHTS:
            raise ValueError(f"weights {weights!r}: choose one of {WEIGHTS}")
        self.weights, self.device = weights, m.embed_tokens.weight.device
        self.dtype = m.embed_tokens.weight.dtype if weights == "model" else torch.float32  # activations
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype {kv_dtype!r}: choose one of {[k for k in KV_DTYPES if k]}")
        self.kv_dtype = KV_DTYPES[kv_dtype] or self.dtype
        fp32_cpu = self.device.type == "cpu" and self.dtype == torch.float32
        self.fused = native.ops() if fused and fp32_cpu else None
        if weights == "gguf" and self.fused is None:
            raise ValueError(f"GGUF weights need the fused CPU kernels (fp32 on a CPU): {native.error}")
        scale = self.head_dim ** -0.5
        folded = weights != "gguf" and math.log2(scale).is_integer()  # a power of two: scaling weights is exact
        self.attn_scale = 1.0 if folded else scale  # what the attention itself still applies
        self.embed = m.embed_tokens.weight if weights != "gguf" else None  # gguf: the head's rows (lm_head.rows)
        self.norm = m.norm.weight.to(self.dtype)
        self.rotary = m.rotary_emb
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin of positions [0, 2^k) (_rope)
        blocks = gguf_layers(gguf, cfg) if weights == "gguf" else None
        make = {"model": Dense, "bf16": lambda w, b=None: Bf16Dense(w, b, self.fused)}.get(weights)
        self.layers = []
        with torch.no_grad():
            self.lm_head = make(hf_model.lm_head.weight) if make else GgufDense(*blocks[0]["embed"], self.fused)
            if take and hf_model.lm_head.weight is not m.embed_tokens.weight:
                _release([hf_model.lm_head])
            for i, layer in enumerate(m.layers):
                a, mlp = layer.self_attn, layer.mlp
                if make:
                    dense = (_fused(make, [a.q_proj, a.k_proj, a.v_proj], [scale if folded else 1.0, 1.0, 1.0]),
                             _fused(make, [a.o_proj]), _fused(make, [mlp.gate_proj, mlp.up_proj]),
                             _fused(make, [mlp.down_proj]))
                else:
                    b = blocks[1][i]
                    dense = tuple(GgufDense(*b[k], self.fused, _bias(projs)) for k, projs in (
                        ("qkv", [a.q_proj, a.k_proj, a.v_proj]), ("o", [a.o_proj]),
                        ("gate_up", [mlp.gate_proj, mlp.up_proj]), ("down", [mlp.down_proj])))
                self.layers.append((layer.input_layernorm.weight.to(self.dtype), dense[0], dense[1],
                                    layer.post_attention_layernorm.weight.to(self.dtype), dense[2], dense[3]))
                if take:
                    _release([a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
        if take:
            hf_model.forward = _taken
        self.compiled_step = CompiledStep(self._traced)  # decode-only steps through torch.compile (forward)
        self._native: dict[int, tuple | None] = {}  # row bucket -> lab.layers' weights and kinds, or None
        self.kernels = self._choose_kernels(kernel, remeasure) if weights == "model" else {}
        # (in, out) -> {"choice": per bucket, "ms": timings}; other storage has one product per level

    def _choose_kernels(self, kernel: str | None, remeasure: bool) -> dict:
        groups = {}
        for d in self.products:
            groups.setdefault(tuple(d.shape), []).append(d)
        dev, dtype = self.device, self.dtype
        if kernel is not None:
            if kernel not in kernels.candidates(dev, dtype):
                raise ValueError(f"kernel {kernel!r} does not run here; choose from {kernels.candidates(dev, dtype)}")
            chosen = {shape: {"choice": [kernel] * len(kernels.BUCKETS), "ms": None} for shape in groups}
        else:
            with torch.no_grad():
                chosen = kernels.choose(groups, dev, dtype, remeasure)
        for shape, mats in groups.items():
            for d in mats:
                d.products = list(chosen[shape]["choice"])
                d.hold(d.products)
        return chosen

    @property
    def products(self) -> list:
        """Every matrix product of a step: the LM head, then each layer's qkv, o, gate/up and down."""
        return [self.lm_head, *(d for l in self.layers for d in (l[1], l[2], l[4], l[5]))]

    @property
    def step_bytes(self) -> int:
        """Bytes of weights one step reads: every product's weight once, in the layout it multiplies."""
        return sum(d.weight_bytes for d in self.products)

    @property
    def arithmetic(self) -> list[str]:
        """How the products compute on this machine: GGUF and bf16 weights say so; fp32 is fp32 (kernels)."""
        return sorted({getattr(d, "arithmetic", "fp32") for d in self.products})

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
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    @torch.inference_mode()
    def forward(self, inputs: StepInputs, cache, compiled: bool = False, graphs: bool = False) -> torch.Tensor:
        """float32 logits [len(inputs.logit_rows), vocab]. compiled: a step of decodes only (DenseDecode) runs
        through torch.compile, each step shape (one row; several; per kernel row bucket) compiled once per process
        (engine/model/compiled.py; LLMEngine.warm_up compiles them all up front), eager where compiling fails. graphs: such
        a step is padded to a few shapes (_bucketed), on CUDA each captured once as a CUDA graph and replayed."""
        threads.tick()
        if not (isinstance(inputs.attention, DenseDecode) and (compiled or graphs)):
            return self._forward(inputs, cache)
        n = inputs.logit_rows.shape[0]
        if graphs:
            inputs = self._bucketed(inputs, cache)
        if compiled:
            logits = self.compiled_step(inputs, cache, static=lambda: cache.k + cache.v,
                                        cuda_graphs=graphs and self.device.type == "cuda")
        else:
            logits = self._forward(inputs, cache)
        return logits[:n].clone() if graphs else logits  # a graph's outputs are overwritten by its next replay

    def _bucketed(self, inputs: StepInputs, cache) -> StepInputs:
        """A dense decode step padded to one of few shapes: seats to the next power of two (at most the cache's),
        keys to the next multiple of KEY_BUCKET (at most a seat), each row masked to its own keys. A padded row
        decodes token 0 in its own seat at the seat's last position, which no request ever writes (prompt +
        max_new_tokens fit the seat and the last token is never fed back), and attends every key; its logits are
        dropped. All rows' logits are taken, in seat order."""
        a, dev = inputs.attention, inputs.ids.device
        S = a.num_seats
        Sb = min(1 << (S - 1).bit_length(), cache.k[0].shape[0])
        Lb = min(-(-a.length // KEY_BUCKET) * KEY_BUCKET, cache.seat_len)
        rows = torch.arange(Sb, device=dev)
        pos = torch.cat([inputs.positions, inputs.positions.new_full((Sb - S,), cache.seat_len - 1)])
        j, p = torch.arange(Lb, device=dev)[None, :], pos[:, None]
        masked = j > p if self.window is None else (j > p) | (j <= p - self.window)
        masked &= (rows < S)[:, None]  # padded rows see every key: no row is all -inf (no NaN written anywhere)
        bias = torch.zeros(masked.shape, dtype=self.dtype, device=dev).masked_fill_(masked, -torch.inf)
        ids = torch.cat([inputs.ids, inputs.ids.new_zeros(Sb - S)])
        return replace(inputs, ids=ids, positions=pos, places=rows, logit_rows=rows,
                       attention=DenseDecode(Sb, Lb, bias[:, None, None, :]),
                       end=cache.seat_len if Sb > S else inputs.end)

    def _traced(self, inputs: StepInputs, cache) -> torch.Tensor:
        """The step torch.compile traces: the Python layer loop (the compiler fuses what lab.layers would)."""
        return self._forward(inputs, cache, native=False)

    def _forward(self, inputs: StepInputs, cache, native: bool = True) -> torch.Tensor:
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        x = F.embedding(inputs.ids, self.embed) if self.embed is not None else self.lm_head.rows(inputs.ids)
        cos, sin = self._rope(inputs.positions, inputs.end, traced=not native)  # [T, D]
        T = inputs.ids.shape[0]
        rows = cache.rows(inputs.places, inputs.positions)  # flat cache rows of this step's tokens
        layers = self._native_layers(T, inputs.attention) if native and not isinstance(cache, CatCache) else None
        if layers is not None:  # every layer in one call (not on the cat cache, which grows in write)
            a = inputs.attention
            spans, keys = (a.spans, a.key_rows) if isinstance(a, Spans) else (None, None)
            seats, length, bias = (a.num_seats, a.length, a.bias) if isinstance(a, DenseDecode) else (0, 0, None)
            x = self.fused.layers(x, *layers, cos, sin, cache.k, cache.v, rows, spans, keys, bias, seats,
                                  length, H, self.eps, self.attn_scale)
            return self.lm_head(self._norm(x[inputs.logit_rows], self.norm)).float()
        for i, (ln1, wqkv, wo, ln2, wgu, wd) in enumerate(self.layers):
            qkv = wqkv(self._norm(x, ln1))
            qk = self._rotary(qkv[:, :(H + KV) * D].view(T, H + KV, D), cos, sin)  # q and k together
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + KV) * D:].view(T, KV, D)
            cache.write(i, rows, k, v, self.fused)
            attn = inputs.attention.attend(self, i, q, k, v, cache)
            x = wo(attn.reshape(T, H * D), residual=x)  # a view on real devices (attn is contiguous)
            if T <= ROW_BLOCK:
                x = self._mlp(x, ln2, wgu, wd)
            else:
                x = torch.cat([self._mlp(xb, ln2, wgu, wd) for xb in x.split(ROW_BLOCK)])
        return self.lm_head(self._norm(x[inputs.logit_rows], self.norm)).float()

    def _native_layers(self, rows: int, attention) -> tuple | None:
        """Every layer's weights and product kinds, one after another, for lab.layers at this row count, or None where
        the Python loop runs: no fused kernels, another activation than SiLU, attention other than DenseDecode or
        Spans, more rows than a row block, or a product lab.layers does not call."""
        if self.fused is None or self.act is not F.silu or rows > ROW_BLOCK \
                or not isinstance(attention, (DenseDecode, Spans)):
            return None
        b = kernels.bucket(rows)
        if b not in self._native:
            weights, kinds = [], []
            for ln1, wqkv, wo, ln2, wgu, wd in self.layers:
                parts = [native_product(d, b) for d in (wqkv, wo, wgu, wd)]
                if None in parts:
                    self._native[b] = None
                    break
                weights += [ln1, ln2, *(t for kind, *ts in parts for t in ts)]
                kinds += [kind for kind, *_ in parts]
            else:
                self._native[b] = (weights, kinds)
        return self._native[b]

    def _norm(self, x, w):
        if self.fused is not None:
            return self.fused.rms_norm(x, w, self.eps)
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _rope(self, positions: torch.Tensor, end: int, traced: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, D] of each position (all below `end`), sin's first half negated (rotate_half(x) * sin =
        swap(x) * this): rows of a table the model's rotary module computed once for positions [0, 2^k) (its
        frequencies are fixed: engine/model/support.py), grown when a step reaches past it; a traced step computes its own
        (no table that grows under torch.compile)."""
        if traced:
            return self._rope_rows(positions)
        if self._rope_table is None or self._rope_table[0].shape[0] < end:
            self._rope_table = self._rope_rows(torch.arange(1 << (end - 1).bit_length(), device=self.device))
        cos, sin = self._rope_table
        return cos[positions], sin[positions]

    def _rope_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        D = self.head_dim
        cos, sin = self.rotary(self.norm, positions[None])  # its x argument gives only the dtype and device
        return cos[0], torch.cat([-sin[0, :, :D // 2], sin[0, :, D // 2:]], dim=-1)

    def _rotary(self, qk, cos, sin):
        """qk [T, heads, D]: x * cos + x with its halves swapped * sin (cos, sin [T, D]; sin's first half negated); in
        place on the fused kernel's path."""
        if self.fused is not None:
            self.fused.rotary_(qk, cos, sin)
            return qk
        T, heads, D = qk.shape
        return qk.view(T, heads, 2, D // 2).flip(2).view(qk.shape).mul_(sin[:, None]).addcmul_(qk, cos[:, None])

    def _mlp(self, x, ln, wgu, wd):
        """x + down(act(gate) * up) of rms_norm(x)."""
        gu = wgu(self._norm(x, ln))
        if self.fused is not None and self.act is F.silu:
            return wd(self.fused.silu_mul(gu), residual=x)
        gate, up = gu.chunk(2, dim=-1)
        return wd(self.act(gate) * up, residual=x)
