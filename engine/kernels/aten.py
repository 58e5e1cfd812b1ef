"""ATen's packed matrix products on fp32 CPUs, as operators a compiled graph calls whole (torch.ops.flat): MKL's GEMM
on a weight packed once into its own layout (`packed`), and oneDNN's inner product on a weight reordered once into
its blocked layout, the residual added inside it (`onednn`). Inductor's lowering of the MKL operator needs a fixed
row count and oneDNN's expects a frozen graph, so compiled steps call these operators; eager steps call ATen's
directly (no Python wrapper on the way)."""
import torch


def pack(w_out_in: torch.Tensor) -> torch.Tensor:
    """MKL's layout of a weight [out, in]; it does not depend on the row count (64: a hint)."""
    return torch.ops.mkl._mkl_reorder_linear_weight(w_out_in, 64)


def reorder(w_out_in: torch.Tensor) -> torch.Tensor:
    """oneDNN's layout of a weight [out, in]; no row-count hint: one layout serves every row count."""
    return torch.ops.mkldnn._reorder_linear_weight(w_out_in.contiguous(), None)


def _onednn(x, weight, bias, residual):
    """oneDNN's inner product on its reordered weight, + residual inside it when given."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, weight, bias, "add")


_OPS = torch.library.Library("flat", "DEF")
_OPS.define("packed_linear(Tensor x, Tensor packed, Tensor w_out_in, Tensor? bias) -> Tensor")
_OPS.impl("packed_linear", lambda x, packed, w, bias: torch.ops.mkl._mkl_linear(x, packed, w, bias, x.shape[0]),
          "CompositeExplicitAutograd")
_OPS.define("onednn_linear(Tensor x, Tensor weight, Tensor w_out_in, Tensor? bias, Tensor? residual) -> Tensor")
_OPS.impl("onednn_linear", lambda x, weight, w, bias, residual: _onednn(x, weight, bias, residual),
          "CompositeExplicitAutograd")


@torch.library.register_fake("flat::packed_linear")
def _packed_linear_shape(x, packed, w, bias):
    return x.new_empty(x.shape[0], w.shape[0])


@torch.library.register_fake("flat::onednn_linear")
def _onednn_linear_shape(x, weight, w, bias, residual):
    return x.new_empty(x.shape[0], w.shape[0])


def packed_linear(x, packed, size, bias, residual=None) -> torch.Tensor:
    """x W^T (+ bias) (+ residual) on MKL's packed weight; size: a tensor of shape [out, in] (its sizes are read)."""
    if torch.compiler.is_compiling():
        y = torch.ops.flat.packed_linear(x, packed, size, bias)
    else:
        y = torch.ops.mkl._mkl_linear(x, packed, size, bias, x.shape[0])
    return y if residual is None else y.add_(residual)


def onednn_linear(x, weight, size, bias, residual=None) -> torch.Tensor:
    """x W^T (+ bias) (+ residual, inside the product) on oneDNN's reordered weight; size: as packed_linear's."""
    if torch.compiler.is_compiling():
        return torch.ops.flat.onednn_linear(x, weight, size, bias, residual)
    return _onednn(x, weight, bias, residual)
