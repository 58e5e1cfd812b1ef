"""RMS norm over the last dim, times a weight: (x * rsqrt(mean(x^2) + eps)) * w, the native kernel where it is built
(fp32 on a CPU), ATen's otherwise; chosen once, when the model is built."""
import torch.nn.functional as F


def rms_norm(ops, eps: float):
    """norm(x, w): w [dim], or [heads, dim] for x [T, heads, dim] (each head its own weight: the norm, then a product
    by w)."""
    def heads(x, w):
        return F.rms_norm(x, (x.shape[-1],), None, eps) * w

    def aten(x, w):
        return heads(x, w) if w.dim() > 1 else F.rms_norm(x, (x.shape[-1],), w, eps)

    def native(x, w):
        return heads(x, w) if w.dim() > 1 else ops.rms_norm(x, w, eps)

    return aten if ops is None else native
