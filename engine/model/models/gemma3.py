"""Gemma 3 (gemma3_text): (1 + w) RMS norms computed in fp32 as Hugging Face does, four norms a layer (the attention's
and the MLP's outputs normed before their residuals), per-head q/k norms before the rotary, embeddings times
sqrt(hidden), GeGLU, attention scale query_pre_attn_scalar^-0.5, sliding and full layers each with its own rotary
base. It runs the Python layer loop (with the native products, rotary and attention): its norms, GeGLU and per-layer
rotary tables are not what lab.layers computes."""
import torch

from engine.model.forward import FlatModel
from engine.model.support import FOREIGN, PROJECTIONS
from engine.model.weights import head_norms

LAYER_TYPES = ("full_attention", "sliding_attention")


class Gemma3(FlatModel):
    model_types = ("gemma3_text",)
    activation_field, activations = "hidden_activation", ("gelu_pytorch_tanh",)
    foreign = (*FOREIGN, "use_bidirectional_attention")
    layer_params = PROJECTIONS | {f"{n}.weight" for n in (
        "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
        "self_attn.q_norm", "self_attn.k_norm")}
    qk_norms = True
    gguf_permuted = False  # llama.cpp stores its q/k rows in Hugging Face's order

    @classmethod
    def check(cls, cfg) -> None:
        if not set(cfg.layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types = {cfg.layer_types!r} is not supported by the engine ({cfg.model_type}); "
                             f"each layer is one of {LAYER_TYPES}")

    @classmethod
    def ropes(cls, cfg) -> dict:
        rope = dict(cfg.rope_parameters or {})
        return {key: dict(rope[key]) for key in sorted(set(cfg.layer_types))}

    @classmethod
    def layer_windows(cls, cfg) -> list[int | None]:
        return [cfg.sliding_window if t == "sliding_attention" else None for t in cfg.layer_types]

    @classmethod
    def rope_keys(cls, cfg) -> list:
        return list(cfg.layer_types)

    @classmethod
    def attention_scale(cls, cfg, head_dim: int) -> float:
        return cfg.query_pre_attn_scalar ** -0.5

    @classmethod
    def embedding_scale(cls, cfg, dtype: torch.dtype) -> float:
        """sqrt(hidden) as a float32 tensor cast to the activations' dtype, as Hugging Face computes it."""
        return torch.tensor(cfg.hidden_size ** 0.5).to(dtype).item()

    @staticmethod
    def make_norm(ops, eps: float):
        """In fp32 activations the plain norm (w is 1 + w already); in bf16 (a GPU level) x widened, normed, times
        w, then cast back, as Hugging Face does."""
        fp32 = FlatModel.make_norm(ops, eps)

        def norm(x, w):
            if x.dtype == torch.float32:
                return fp32(x, w)
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
        return norm

    def norm_weight(self, norm) -> torch.Tensor:
        """1 + w in fp32 (its norm's order: w widened, then 1 added)."""
        return 1.0 + norm.weight.float()

    def layer_norms(self, layer) -> dict:
        a, w = layer.self_attn, self.norm_weight
        return {"input_norm": w(layer.input_layernorm), "post_norm": w(layer.pre_feedforward_layernorm),
                "attn_out_norm": w(layer.post_attention_layernorm), "mlp_out_norm": w(layer.post_feedforward_layernorm),
                "qk_norm": head_norms(w(a.q_norm), w(a.k_norm), self.num_heads, self.num_kv_heads)}
