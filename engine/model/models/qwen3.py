"""Qwen3: Qwen2's layer with an RMS norm (times w) on each q and k head after the product, before the rotary, and
no q/k/v biases unless attention_bias says so; windowed only when every layer is."""
from engine.model.models.llama import Llama
from engine.model.weights import head_norms


class Qwen3(Llama):
    model_types = ("qwen3",)
    layer_params = Llama.layer_params | {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    qk_norms = True

    def layer_norms(self, layer) -> dict:
        a = layer.self_attn
        return {**super().layer_norms(layer),
                "qk_norm": head_norms(self.norm_weight(a.q_norm), self.norm_weight(a.k_norm), self.num_heads,
                                      self.num_kv_heads)}
