"""The engine's layers built from a Hugging Face model: each decoder layer's norms and four products
(engine/model/layers/linear.py), q/k/v and gate/up concatenated into one matrix each, in the storage a precision level
asks for (`weights`): "model" as the Hugging Face model holds them, "bf16", or "gguf" (the blocks of the model's GGUF
file as stored, engine/model/gguf.py). The attention scale is folded into the q rows when that is exact in any dtype (a
power of two, as for head_dim 64 or 16); otherwise (head_dim 128: 2^-3.5) the attention applies it, as Hugging Face
does. With `take` the Hugging Face model gives up each layer's weights as soon as the engine holds them (the weights
then exist once) and cannot run afterwards."""
import math
from dataclasses import dataclass

import torch

from engine.kernels import choice
from engine.model.gguf import gguf_layers
from engine.model.layers.linear import Bf16Dense, Dense, GgufDense

PRODUCTS = ("qkv", "o", "gate_up", "down")  # a layer's products, in the order lab.layers runs them
LAYER_WEIGHTS = ("input_norm", "post_norm", *(f"{p}.{part}" for p in PRODUCTS for part in ("weight", "aux", "bias")))
# ^ the tensors a layer passes to lab.layers, in its order (engine/kernels/csrc/layer.cpp; capabilities() names them)


@dataclass
class Layer:
    input_norm: torch.Tensor           # [hidden] RMS norm weight before the attention
    qkv: object                        # q, k and v projections side by side (a linear.py storage)
    o: object                          # the attention's output projection
    post_norm: torch.Tensor            # [hidden] RMS norm weight before the MLP
    gate_up: object                    # gate and up projections side by side
    down: object                       # the MLP's down projection
    attn_out_norm: torch.Tensor | None = None  # or [hidden]: the attention's output normed before the residual
    mlp_out_norm: torch.Tensor | None = None   # or [hidden]: the MLP's output normed before the residual
    qk_norm: torch.Tensor | None = None        # or [q heads + kv heads, head_dim]: each head's norm weight

    @property
    def products(self) -> tuple:
        return tuple(getattr(self, p) for p in PRODUCTS)

    def lab_args(self, bucket: int) -> tuple[list, list] | None:
        """(this layer's LAYER_WEIGHTS, its product kinds) for lab.layers at a row bucket; None where a product is
        one lab.layers does not call."""
        parts = dict(zip(PRODUCTS, (d.lab_args(bucket) for d in self.products)))
        if None in parts.values():
            return None
        named = {"input_norm": self.input_norm, "post_norm": self.post_norm}
        for p, (kind, *tensors) in parts.items():
            named.update(zip((f"{p}.weight", f"{p}.aux", f"{p}.bias"), tensors))
        return [named[w] for w in LAYER_WEIGHTS], [parts[p][0] for p in PRODUCTS]

    @property
    def norms(self) -> list[torch.Tensor]:
        return [n for n in (self.input_norm, self.post_norm, self.attn_out_norm, self.mlp_out_norm, self.qk_norm)
                if n is not None]


def scales(scale: float, weights: str, foldable: bool = True) -> tuple[float, float]:
    """(factor folded into the q rows, factor the attention still applies) for an attention scale: it goes into the q
    rows when it is a power of two (scaling the weights is then exact), the weights are values (not GGUF blocks) and
    nothing between the product and the attention would undo it (`foldable`; a norm on the q heads would)."""
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


def head_norms(q_norm: torch.Tensor, k_norm: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """[heads + kv_heads, head_dim]: the q heads' norm weight, then the kv heads' (Layer.qk_norm)."""
    return torch.cat([q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)])


@torch.no_grad()
def build_layers(net, hf_model, q_scale: float, gguf=None, take: bool = False) -> tuple[object, list[Layer]]:
    """(LM head, layers) of a Hugging Face model in the storage `net.weights`, norms as `net.layer_norms` gives them
    (its architecture's); net.ops: the native kernels (engine/kernels/build.py) or None; q_scale: the factor folded
    into the q rows (`scales`); gguf: the GGUF file's path (weights "gguf": the head is the tied embedding's blocks)."""
    m, ops = hf_model.model, net.ops
    a8 = net.precision.activations == "int8"  # gguf: x quantized to 8 bits per block at each product
    blocks = (gguf_layers(gguf, hf_model.config, net.gguf_permuted, net.precision.requantize)
              if net.weights == "gguf" else None)
    make = {"model": lambda w, b=None: Dense(w, b, ops),
            "bf16": lambda w, b=None: Bf16Dense(w, b, ops)}.get(net.weights)
    lm_head = make(hf_model.lm_head.weight) if make else GgufDense(*blocks[0]["embed"], ops, a8=a8)
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
            products = tuple(GgufDense(*b[k], ops, _bias(projs), a8=a8) for k, projs in (
                ("qkv", [a.q_proj, a.k_proj, a.v_proj]), ("o", [a.o_proj]),
                ("gate_up", [mlp.gate_proj, mlp.up_proj]), ("down", [mlp.down_proj])))
        qkv, o, gate_up, down = products
        layers.append(Layer(qkv=qkv, o=o, gate_up=gate_up, down=down, **net.layer_norms(layer)))
        if take:
            _release([a.q_proj, a.k_proj, a.v_proj, a.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj])
    if take:
        hf_model.forward = _taken
    return lm_head, layers


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
        each = [choice.candidates_of(mats[0], device, dtype) for mats in groups.values()]
        runs = [k for k in each[0] if all(k in c for c in each)]  # what every product runs
        if kernel not in runs:
            raise ValueError(f"kernel {kernel!r} does not run here; choose from {runs}")
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
