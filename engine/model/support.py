"""What an architecture is to the engine: `Architecture`, the hooks a family (engine/model/models/, one file each)
sets: which config fields it reads and refuses, each layer's window and rotary table, the attention and embedding
scales, its norms' weights and rule. `check_supported` refuses, by name, a field whose effect the forward pass
(engine/model/forward.py) would not reproduce."""
from functools import partial

import torch
import torch.nn.functional as F

from engine.model.layers.norm import rms_norm

# hidden_act / hidden_activation -> the function (HF's "gelu" is the exact erf form, "gelu_pytorch_tanh" the tanh one)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies: the model's rotary module is reused as is
PROJECTIONS = frozenset(f"{block}.{proj}_proj.{t}" for block, projs in (("self_attn", "qkvo"),
                                                                         ("mlp", ("gate", "up", "down")))
                        for proj in projs for t in ("weight", "bias"))
FOREIGN = ("use_qk_norm", "qk_layernorm", "embedding_multiplier", "logits_scaling", "residual_multiplier",
           "attention_multiplier", "attn_logit_softcapping", "final_logit_softcapping")  # terms no family computes


class Architecture:
    """A family's hooks, read from the class (before a model is built) or the built model."""
    model_types: tuple[str, ...] = ()      # Hugging Face model_type values the family runs
    activation_field = "hidden_act"        # the config field naming the MLP's activation
    activations: tuple[str, ...] = ()      # the values of it the forward pass computes
    foreign: tuple[str, ...] = FOREIGN     # fields that change the forward pass in ways it does not: refused when set
    layer_params: frozenset = frozenset()  # a decoder layer's parameter names (below its index)
    qk_norms = False                       # a norm on each q and k head after the product (no scale folded into q)
    gguf_permuted = True                   # llama.cpp stores the q/k rows permuted (engine/model/gguf.py)

    @classmethod
    def check(cls, cfg) -> None:
        """Family rules beyond the common ones (raise ValueError naming the field)."""

    @classmethod
    def ropes(cls, cfg) -> dict:
        """Rotary parameters by rotary key (rope_keys' values): one set for every layer."""
        return {None: dict(cfg.rope_parameters or {})}

    @classmethod
    def layer_windows(cls, cfg) -> list[int | None]:
        """Each layer's window: the tokens a query attends (itself included); None = every one before it."""
        return [None] * cfg.num_hidden_layers

    @classmethod
    def rope_keys(cls, cfg) -> list:
        """The argument each layer's rotary table is computed with (None: one table)."""
        return [None] * cfg.num_hidden_layers

    @classmethod
    def activation(cls, cfg):
        return ACTIVATIONS[getattr(cfg, cls.activation_field)]

    @classmethod
    def attention_scale(cls, cfg, head_dim: int) -> float:
        """The factor on q.k."""
        return head_dim ** -0.5

    @classmethod
    def embedding_scale(cls, cfg, dtype: torch.dtype) -> float | None:
        """The factor on the embeddings; None: none."""
        return None

    @staticmethod
    def make_norm(ops, eps: float):
        """norm(x, w) as the family computes it."""
        return rms_norm(ops, eps)

    def norm_weight(self, norm) -> torch.Tensor:
        """An RMS norm module's weight as the engine multiplies by it: in the activations' dtype."""
        return norm.weight.to(self.dtype)

    def layer_norms(self, layer) -> dict:
        """A Hugging Face decoder layer's norm weights, by engine/model/weights.py's Layer field."""
        return {"input_norm": self.norm_weight(layer.input_layernorm),
                "post_norm": self.norm_weight(layer.post_attention_layernorm)}


def check_supported(arch: type[Architecture], hf_model) -> None:
    """Refuse, with a ValueError naming the field, a model whose forward pass engine/model/forward.py would not
    reproduce under `arch`."""
    cfg = hf_model.config

    def refuse(field, value, supported):
        raise ValueError(f"{field} = {value!r} is not supported by the engine ({cfg.model_type}); {supported}")

    if getattr(cfg, arch.activation_field) not in arch.activations:
        refuse(arch.activation_field, getattr(cfg, arch.activation_field), f"it runs {arch.activations}")
    for key, rope in arch.ropes(cfg).items():
        where = "rope_parameters" + (f".{key}" if key else "")
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            refuse(f"{where}.rope_type", rope.get("rope_type"), f"it runs {ROPE_TYPES}")
        if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
            refuse("partial_rotary_factor", rope["partial_rotary_factor"], "it rotates the whole head (1.0)")
    if getattr(cfg, "partial_rotary_factor", None) not in (None, 1, 1.0):
        refuse("partial_rotary_factor", cfg.partial_rotary_factor, "it rotates the whole head (1.0)")
    for field in arch.foreign:
        if getattr(cfg, field, None) not in (None, False):
            refuse(field, getattr(cfg, field), "no such term in its forward pass")
    for name, _ in hf_model.model.layers.named_parameters():
        if name.split(".", 1)[1] not in arch.layer_params:
            refuse("layer parameter", name, f"a layer holds only {sorted(arch.layer_params)}")
    if getattr(hf_model.lm_head, "bias", None) is not None:
        refuse("lm_head.bias", "present", "the output projection has no bias")
    arch.check(cfg)
