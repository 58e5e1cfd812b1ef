"""Which model configs the engine's forward pass (engine/model/forward.py) computes: check_supported refuses, by name, a
field whose effect it would not reproduce; attention_window reads the sliding window a supported config sets."""
import torch.nn.functional as F

SUPPORTED = ("llama", "mistral", "qwen2")
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu}  # hidden_act -> the function (HF's "gelu" is the exact erf form)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies: the model's rotary module is reused as is
# fields of other families' configs that change the forward pass; refused when set rather than ignored
FOREIGN_FIELDS = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "use_qk_norm",
                  "qk_layernorm", "embedding_multiplier", "logits_scaling", "residual_multiplier",
                  "attention_multiplier")
LAYER_PARAMS = {f"{block}.{proj}_proj.{t}" for block, projs in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
                for proj in projs for t in ("weight", "bias")} | {"input_layernorm.weight",
                                                                     "post_attention_layernorm.weight"}


def check_supported(hf_model) -> None:
    """Refuse, with a ValueError naming the field, a model whose forward pass engine/model/forward.py would not
    reproduce."""
    cfg = hf_model.config

    def refuse(field, value, supported):
        raise ValueError(f"{field} = {value!r} is not supported by the engine ({cfg.model_type}); {supported}")

    if cfg.model_type not in SUPPORTED:
        refuse("model_type", cfg.model_type, f"it runs {SUPPORTED}")
    if cfg.hidden_act not in ACTIVATIONS:
        refuse("hidden_act", cfg.hidden_act, f"it runs {tuple(ACTIVATIONS)}")
    rope = dict(cfg.rope_parameters or {})
    if rope.get("rope_type", "default") not in ROPE_TYPES:
        refuse("rope_parameters.rope_type", rope.get("rope_type"), f"it runs {ROPE_TYPES}")
    for factor in (rope.get("partial_rotary_factor"), getattr(cfg, "partial_rotary_factor", None)):
        if factor not in (None, 1, 1.0):
            refuse("partial_rotary_factor", factor, "it rotates the whole head (1.0)")
    for field in FOREIGN_FIELDS:
        if getattr(cfg, field, None) not in (None, False):
            refuse(field, getattr(cfg, field), "no such term in its forward pass")
    for name, _ in hf_model.model.layers.named_parameters():
        if name.split(".", 1)[1] not in LAYER_PARAMS:
            refuse("layer parameter", name, f"a layer holds only {sorted(LAYER_PARAMS)}")
    if getattr(hf_model.lm_head, "bias", None) is not None:
        refuse("lm_head.bias", "present", "the output projection has no bias")
    if cfg.model_type != "mistral" and _layer_types(cfg) not in ({"full_attention"}, {"sliding_attention"}):
        refuse("layer_types", cfg.layer_types, "the window must cover every layer or none "
               "(use_sliding_window with max_window_layers = 0 or >= num_hidden_layers)")


def _layer_types(cfg) -> set[str]:
    """qwen2: layers from max_window_layers on are windowed (layer_types); a config without them has none."""
    return set(getattr(cfg, "layer_types", None) or ["full_attention"])


def attention_window(cfg) -> int | None:
    """The tokens each query attends (itself included) in a supported config; None = every one before it. Mistral
    windows every layer when sliding_window is set; qwen2 only when every layer is windowed."""
    if cfg.model_type == "mistral" or _layer_types(cfg) == {"sliding_attention"}:
        return cfg.sliding_window
    return None
