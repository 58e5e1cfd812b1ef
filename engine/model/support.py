"""Which model configs the engine's forward pass (engine/model/forward.py) computes: check_supported refuses, by name, a
field whose effect it would not reproduce; the other functions read what a supported config sets (each layer's window
and rotary table, the attention scale, the embedding scale).

Two families: Llama (llama, mistral, qwen2) and Gemma 3 (gemma3_text: (1 + w) RMSNorm in fp32, four norms a layer,
per-head q/k norms before the rotary, embeddings times sqrt(hidden), GeGLU, attention scale query_pre_attn_scalar^-0.5,
sliding and full layers, each with its own rotary base)."""
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

# hidden_act / hidden_activation -> the function (HF's "gelu" is the exact erf form, "gelu_pytorch_tanh" the tanh one)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh")}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies: the model's rotary module is reused as is
GEMMA = ("gemma3_text",)
LAYER_TYPES = ("full_attention", "sliding_attention")  # Gemma 3's per-layer attention kinds
_PROJECTIONS = {f"{block}.{proj}_proj.{t}" for block, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                for proj in projs for t in ("weight", "bias")}
_FOREIGN = ("use_qk_norm", "qk_layernorm", "embedding_multiplier", "logits_scaling", "residual_multiplier",
            "attention_multiplier")


@dataclass(frozen=True)
class Family:
    activation: str                    # the config field naming the MLP's activation
    activations: tuple[str, ...]       # the values of it this pass computes
    foreign: tuple[str, ...]           # fields that change the forward pass in ways it does not: refused when set
    layer_params: frozenset            # a decoder layer's parameter names (below its index)


LLAMA = Family("hidden_act", ("silu", "gelu"),
               ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", *_FOREIGN),
               frozenset(_PROJECTIONS | {"input_layernorm.weight", "post_attention_layernorm.weight"}))
GEMMA3 = Family("hidden_activation", ("gelu_pytorch_tanh",),
                ("attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention", *_FOREIGN),
                frozenset(_PROJECTIONS | {f"{n}.weight" for n in (
                    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm")}))
FAMILIES = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gemma3_text": GEMMA3}
SUPPORTED = tuple(FAMILIES)


def check_supported(hf_model) -> None:
    """Refuse, with a ValueError naming the field, a model whose forward pass engine/model/forward.py would not
    reproduce."""
    cfg = hf_model.config

    def refuse(field, value, supported):
        raise ValueError(f"{field} = {value!r} is not supported by the engine ({cfg.model_type}); {supported}")

    if cfg.model_type not in FAMILIES:
        refuse("model_type", cfg.model_type, f"it runs {SUPPORTED}")
    family = FAMILIES[cfg.model_type]
    if getattr(cfg, family.activation) not in family.activations:
        refuse(family.activation, getattr(cfg, family.activation), f"it runs {family.activations}")
    for key, rope in _ropes(cfg).items():
        where = "rope_parameters" + (f".{key}" if key else "")
        if rope.get("rope_type", "default") not in ROPE_TYPES:
            refuse(f"{where}.rope_type", rope.get("rope_type"), f"it runs {ROPE_TYPES}")
        if rope.get("partial_rotary_factor") not in (None, 1, 1.0):
            refuse("partial_rotary_factor", rope["partial_rotary_factor"], "it rotates the whole head (1.0)")
    if getattr(cfg, "partial_rotary_factor", None) not in (None, 1, 1.0):
        refuse("partial_rotary_factor", cfg.partial_rotary_factor, "it rotates the whole head (1.0)")
    for field in family.foreign:
        if getattr(cfg, field, None) not in (None, False):
            refuse(field, getattr(cfg, field), "no such term in its forward pass")
    for name, _ in hf_model.model.layers.named_parameters():
        if name.split(".", 1)[1] not in family.layer_params:
            refuse("layer parameter", name, f"a layer holds only {sorted(family.layer_params)}")
    if getattr(hf_model.lm_head, "bias", None) is not None:
        refuse("lm_head.bias", "present", "the output projection has no bias")
    if family is GEMMA3 and not set(cfg.layer_types) <= set(LAYER_TYPES):
        refuse("layer_types", cfg.layer_types, f"each layer is one of {LAYER_TYPES}")
    if family is LLAMA and cfg.model_type != "mistral" \
            and _layer_types(cfg) not in ({"full_attention"}, {"sliding_attention"}):
        refuse("layer_types", cfg.layer_types, "the window must cover every layer or none "
               "(use_sliding_window with max_window_layers = 0 or >= num_hidden_layers)")


def _ropes(cfg) -> dict:
    """Rotary parameters by layer type (Gemma 3), or under None (one set for every layer)."""
    rope = dict(cfg.rope_parameters or {})
    if cfg.model_type in GEMMA:
        return {key: dict(rope[key]) for key in sorted(set(cfg.layer_types))}
    return {None: rope}


def _layer_types(cfg) -> set[str]:
    """qwen2: layers from max_window_layers on are windowed (layer_types); a config without them has none."""
    return set(getattr(cfg, "layer_types", None) or ["full_attention"])


def attention_window(cfg) -> int | None:
    """The tokens each query attends (itself included) in a supported Llama-family config; None = every one before
    it. Mistral windows every layer when sliding_window is set; qwen2 only when every layer is windowed."""
    if cfg.model_type == "mistral" or _layer_types(cfg) == {"sliding_attention"}:
        return cfg.sliding_window
    return None


def layer_windows(cfg) -> list[int | None]:
    """Each layer's window (attention_window's meaning): Gemma 3's sliding layers attend sliding_window tokens."""
    if cfg.model_type in GEMMA:
        return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]
    return [attention_window(cfg)] * cfg.num_hidden_layers


def rope_keys(cfg) -> list[str | None]:
    """The argument each layer's rotary table is computed with (Gemma 3: its layer type; None: one table)."""
    return list(cfg.layer_types) if cfg.model_type in GEMMA else [None] * cfg.num_hidden_layers


def activation(cfg):
    return ACTIVATIONS[getattr(cfg, FAMILIES[cfg.model_type].activation)]


def attention_scale(cfg, head_dim: int) -> float:
    """The factor on q.k: query_pre_attn_scalar^-0.5 (Gemma 3), head_dim^-0.5 otherwise."""
    return cfg.query_pre_attn_scalar ** -0.5 if cfg.model_type in GEMMA else head_dim ** -0.5


def embed_scale(cfg, dtype: torch.dtype) -> float | None:
    """The factor on the embeddings (Gemma 3: sqrt(hidden) as a float32 tensor cast to the weights' dtype, as
    Hugging Face computes it); None: none."""
    return torch.tensor(cfg.hidden_size ** 0.5).to(dtype).item() if cfg.model_type in GEMMA else None
