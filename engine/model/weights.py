"""The engine's layers built from a Hugging Face model: each decoder layer's norms and four products
(engine/model/linear.py), q/k/v and gate/up concatenated into one matrix each, in the storage a precision level asks
for (`weights`): "model" as the Hugging Face model holds them, "bf16", or "gguf" (the blocks of the model's GGUF file
as stored, engine/model/gguf.py). The attention scale is folded into the q rows when that is exact in any dtype (a
power of two, as for head_dim 64 or 16); otherwise (head_dim 128: 2^-3.5) the attention applies it, as Hugging Face
does.
With `take` the Hugging Face model gives up each layer's weights as soon as the engine holds them (the weights then
exist once) and cannot run afterwards."""
import math
from dataclasses import dataclass

import torch

from engine.kernels import choice
from engine.model.gguf import gguf_layers
from engine.model.linear import Bf16Dense, Dense, GgufDense
from engine.model.support import GEMMA

WEIGHTS = ("model", "bf16", "gguf")  # how the engine stores the weights (conf/precision: `weights`)


@dataclass
class Layer:
    input_norm: torch.Tensor           # [hidden] RMS norm weight before the attention
    qkv: object                        # q, k and v projections side by side (a linear.py storage)
    o: object                          # the attention's output projection
    post_norm: torch.Tensor            # [hidden] RMS norm weight before the MLP (Gemma 3: pre_feedforward_layernorm)
    gate_up: object                    # gate and up projections side by side
    down: object                       # the MLP's down projection
    attn_out_norm: torch.Tensor | None = None  # Gemma 3: [hidden] norm of the attention's output, before the residual
    mlp_out_norm: torch.Tensor | None = None   # Gemma 3: [hidden] norm of the MLP's output, before the residual
    qk_norm: torch.Tensor | None = None        # Gemma 3: [q heads + kv heads, head_dim] each head's norm weight

    @property
    def products(self) -> tuple:
        return self.qkv, self.o, self.gate_up, self.down

    @property
    def norms(self) -> list[torch.Tensor]:
        return [n for n in (self.input_norm, self.post_norm, self.attn_out_norm, self.mlp_out_norm, self.qk_norm)
                if n is not None]


def scales(scale: float, weights: str, foldable: bool = True) -> tuple[float, float]:
    """(factor folded into the q rows, factor the attention still applies) for an attention scale: it goes into the q
    rows when it is a power of two (scaling the weights is then exact), the weights are values (not GGUF blocks) and
    nothing between the product and the attention would undo it (`foldable`; Gemma 3's q norm would)."""
    if foldable and weights != "gguf" and math.log2(scale).is_integer():
        return scale, 1.0
    return 1.0, scale


def _bias(projections, factors=None) -> torch.Tensor | None:
    """The biases of nn.Linear side by side (output features concatenated), each scaled; a missing bias among
    biased ones counts as zeros; None when none has one."""
    factors = factors or [1.0] * len(projections)
    if all(p.bias is None for p in projections):
        return None
    return torch.cat([p.weight.new_zeros(p.out_features) if p.bias is None else p.bias * s
                      for p, s in zip(projections, factors)])


def _concat(make, projections, factors=None):
    """One product (`make`: a storage class) for several nn.Linear side by side, each scaled."""
    factors = factors or [1.0] * len(projections)
    w = torch.cat([p.weight if s == 1.0 else p.weight * s for p, s in zip(projections, factors)])
    return make(w, _bias(projections, factors))


def _release(linears) -> None:
    """Free nn.Linear weights (and biases) whose values the engine holds in its own layout."""
    for lin in linears:
        lin.weight = torch.nn.Parameter(lin.weight.new_empty(0), requires_grad=False)
        if lin.bias is not None:
            lin.bias = torch.nn.Parameter(lin.bias.new_empty(0), requires_grad=False)


def _taken(*args, **kwargs):
    raise RuntimeError("this Hugging Face model gave its weights to the engine (FlatModel(model, take=True)); "
                       "load it again to run it")


@torch.no_grad()
def build_layers(hf_model, weights: str, dtype: torch.dtype, ops, q_scale: float, gguf=None,
                 take: bool = False) -> tuple[object, list[Layer]]:
    """(LM head, layers) in the storage `weights`; norms in `dtype` (the activations'; Gemma 3's as 1 + w in fp32,
    as its norm computes them); ops: the native kernels (engine/kernels/build.py) or None; q_scale: the factor
    folded into the q rows (`scales`); gguf: the GGUF file's path (weights "gguf": the head is the tied embedding's
    blocks)."""
    m, cfg = hf_model.model, hf_model.config
    gemma = cfg.model_type in GEMMA
    blocks = gguf_layers(gguf, hf_model.config) if weights == "gguf" else None
    make = {"model": Dense, "bf16": lambda w, b=None: Bf16Dense(w, b, ops)}.get(weights)
    lm_head = make(hf_model.lm_head.weight) if make else GgufDense(*blocks[0]["embed"], ops)
    if take and hf_model.lm_head.weight is not m.embed_tokens.weight:
        _release([hf_model.lm_head])
    layers = []
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        if make:
            products = (_concat(make, [a.q_proj, a.k_proj, a.v_proj], [q_scale, 1.0, 1.0]), _concat(make, [a.o_proj]),
                        _concat(make, [mlp.gate_proj, mlp.up_proj]), _concat(make, [mlp.down_proj]))
        else:
            b = blocks[1][i]
            products = tuple(GgufDense(*b[k], ops, _bias(projs)) for k, projs in (
                ("qkv", [a.q_proj, a.k_proj, a.v_proj]), ("o", [a.o_proj]),
                ("gate_up", [mlp.gate_proj, mlp.up_proj]), ("down", [mlp.down_proj])))
        qkv, o, gate_up, down = products
        norms = [norm_weight(n, dtype, gemma) for n in (
            (layer.input_layernorm, layer.pre_feedforward_layernorm, layer.post_attention_layernorm,
             layer.post_feedforward_layernorm, a.q_norm, a.k_norm) if gemma
            else (layer.input_layernorm, layer.post_attention_layernorm))]
        if gemma:  # the q heads' norm weight, then the kv heads'
            norms[4:] = [torch.cat([norms[4].expand(cfg.num_attention_heads, -1),
                                    norms[5].expand(cfg.num_key_value_heads, -1)])]
        layers.append(Layer(norms[0], qkv, o, norms[1], gate_up, down, *norms[2:]))
        if take:
            _release([a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
    if take:
        hf_model.forward = _taken
    return lm_head, layers


def norm_weight(norm, dtype: torch.dtype, gemma: bool) -> torch.Tensor:
    """An RMS norm's weight as the engine multiplies by it: Gemma 3's 1 + w in fp32 (its norm's order: w widened,
    then 1 added), others' w in the activations' dtype."""
    return 1.0 + norm.weight.float() if gemma else norm.weight.to(dtype)


def choose_kernels(products: list, kernel: str | None, remeasure: bool, device: torch.device,
                   dtype: torch.dtype) -> dict:
    """Give each Dense of `products` its product per row bucket: `kernel` for all (a choice.candidates name), or
    each shape's measured choice (engine/kernels/choice.py), `remeasure` measuring it again. Returns
    (in, out) or, for a storage with a family, (in, out, family) -> {"choice": per bucket, "ms": timings or None}."""
    groups = {}
    for d in products:
        family = getattr(d, "family", None)  # a storage's own kernels (GGUF format): a group of their own
        groups.setdefault((*d.shape, family) if family else tuple(d.shape), []).append(d)
    if kernel is not None:
        if kernel not in choice.candidates(device, dtype):
            raise ValueError(f"kernel {kernel!r} does not run here; choose from {choice.candidates(device, dtype)}")
        chosen = {shape: {"choice": [kernel] * len(choice.BUCKETS), "ms": None} for shape in groups}
    else:
        with torch.no_grad():
            chosen = choice.choose(groups, device, dtype, remeasure)
    for shape, mats in groups.items():
        for d in mats:
            d.products = list(chosen[shape]["choice"])
            d.hold(d.products)
    return chosen


def held_bytes(tensors) -> int:
    """Bytes of the storages behind `tensors`, each counted once (packed layouts are opaque: their own size)."""
    seen = {}
    for t in tensors:
        if t is None:
            continue
        try:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except NotImplementedError:
            seen[id(t)] = t.nbytes
    return sum(seen.values())
