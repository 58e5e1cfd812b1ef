"""Which model configs the engine's forward pass (engine/model/forward.py) computes: check_config refuses, by name, a field
whose effect it would not reproduce, and gives the attention window."""
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


def check_config(hf_model) -> int | None:
    """Refuse, with a ValueError naming the field, a model whose forward pass engine/model/forward.py would not reproduce;
    return its attention window (tokens, the query included; None = unlimited)."""
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
    if cfg.model_type == "mistral":  # every layer windowed when sliding_window is set
        return cfg.sliding_window
    layer_types = set(getattr(cfg, "layer_types", None) or ["full_attention"])
    if layer_types == {"sliding_attention"}:
        return cfg.sliding_window
    if layer_types != {"full_attention"}:  # qwen2: layers from max_window_layers on are windowed
        refuse("layer_types", cfg.layer_types, "the window must cover every layer or none "
               "(use_sliding_window with max_window_layers = 0 or >= num_hidden_layers)")
    return None
