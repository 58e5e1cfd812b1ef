"""Llama and its variants Mistral (every layer windowed when sliding_window is set) and Qwen2 (biased q/k/v; windowed
only when every layer is): RMS norms times w, SiLU (or GELU) gated MLP, one rotary table, scale head_dim^-0.5."""
from engine.model.forward import FlatModel
from engine.model.support import FOREIGN, PROJECTIONS


def layer_types(cfg) -> set[str]:
    """Layers from max_window_layers on are windowed (layer_types); a config without them has none."""
    return set(getattr(cfg, "layer_types", None) or ["full_attention"])


class Llama(FlatModel):
    model_types = ("llama",)
    activation_field, activations = "hidden_act", ("silu", "gelu")
    foreign = (*FOREIGN, "query_pre_attn_scalar")
    layer_params = PROJECTIONS | {"input_layernorm.weight", "post_attention_layernorm.weight"}

    @classmethod
    def check(cls, cfg) -> None:
        if layer_types(cfg) not in ({"full_attention"}, {"sliding_attention"}):
            raise ValueError(f"layer_types = {cfg.layer_types!r} is not supported by the engine ({cfg.model_type}); "
                             "the window must cover every layer or none (use_sliding_window with max_window_layers "
                             "= 0 or >= num_hidden_layers)")

    @classmethod
    def layer_windows(cls, cfg) -> list[int | None]:
        window = cfg.sliding_window if layer_types(cfg) == {"sliding_attention"} else None
        return [window] * cfg.num_hidden_layers


class Qwen2(Llama):
    model_types = ("qwen2",)


class Mistral(Llama):
    model_types = ("mistral",)

    @classmethod
    def check(cls, cfg) -> None:
        """Every layer is windowed alike (sliding_window, or none)."""

    @classmethod
    def layer_windows(cls, cfg) -> list[int | None]:
        return [cfg.sliding_window] * cfg.num_hidden_layers
