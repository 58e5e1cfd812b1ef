"""The gated MLP of a decoder layer: x + down(act(gate) * up) of norm(x), its output normed before the residual where
the layer has that norm (mlp_out_norm); SiLU x up as one native kernel where it is built, ATen's otherwise."""
import torch.nn.functional as F


def gated_mlp(act, ops, norm):
    """mlp(x, layer) for an activation `act`, the native kernels `ops` (or None) and the model's `norm`."""
    native = ops is not None and act is F.silu

    def mlp(x, layer):
        gu = layer.gate_up(norm(x, layer.post_norm))
        if native and layer.mlp_out_norm is None:
            return layer.down(ops.silu_mul(gu), residual=x)
        gate, up = gu.chunk(2, dim=-1)
        if layer.mlp_out_norm is not None:
            return x + norm(layer.down(act(gate) * up), layer.mlp_out_norm)
        return layer.down(act(gate) * up, residual=x)

    return mlp
