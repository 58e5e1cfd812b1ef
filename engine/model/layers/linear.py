"""The linear layers' weight storages, one interface: y = x W^T (+ bias) (+ residual) for a weight W [out, in],
`__call__(x, residual=None)`; `shape` (in, out); `dtype` and `device` of what goes in and comes out;
`weight_bytes` (read once per step), `tensors` (held), `arithmetic` (how the product computes here),
`kernel(bucket)` (which kernel runs at a row bucket of engine/kernels/choice.py) and `lab_args(bucket)` (what the
native lab.layers call takes for it, engine/kernels/build.py).

Dense: the model's own values in its dtype, through the product chosen for each row bucket (engine/kernels/choice.py),
  holding only the layouts those products read (ATen's, MKL's, oneDNN's; the native fp32 tiles where they run).
Bf16Dense: bf16 weights; activations rounded to bf16, products summed in fp32 (engine/kernels/csrc/bf16.cpp: vdpbf16ps
  on AVX512-BF16, elsewhere the pairs widened to fp32 and summed with FMA; or tiles widened into cache: the same sums),
  the kernel chosen per row bucket.
GgufDense: a GGUF file's blocks as stored (Q4_1, Q8_0, Q5_0, Q4_K, Q6_K; the parts of a concatenated product each in
  its own), products by the native kernels (engine/kernels/csrc/quant.h), which dequantize in registers (the very
  values the fp32 copy holds) and sum in fp32; on a CPU with AVX512-VNNI Q4_1 sums each block's codes times x exactly
  in integers, x in 30-bit fixed point per block of 32; or dequantize a group of tiles into cache for an fp32 FMA
  kernel; the kernel chosen per row bucket. With 8-bit activations (a8: levels w4a8, w8a8), x is quantized per block
  as llama.cpp quantizes it and each block's codes are summed in int32 (engine/kernels/csrc/a8.h): one kernel at
  every row count.
"""
import itertools
from abc import ABC, abstractmethod

import numpy as np
import torch

from engine.kernels import aten, build
from engine.kernels.choice import BUCKETS, OPAQUE, bucket, default


class Linear(ABC):
    """y = x W^T (+ bias) (+ residual) for a weight W [out, in], through the kernel chosen for the step's row count
    (`products`: one name per row bucket of engine/kernels/choice.py). A storage gives `shape` (in, out), `dtype` and
    `device`, and defines `product`, `lab_args`, `weight_bytes`, `tensors` and `arithmetic`."""
    products: list[str]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """residual: [rows, out], added to the product (inside it where the product allows)."""
        return self.product(self.products[bucket(x.shape[0])], x, residual)

    @abstractmethod
    def product(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x through the kernel `name` (one of the storage's candidates)."""

    @abstractmethod
    def lab_args(self, bucket: int) -> tuple:
        """(kind, weight, aux, bias): what lab.layers takes for this product (engine/kernels/build.py's PRODUCTS)."""

    def kernel(self, bucket: int) -> str:
        return self.products[bucket]

    def hold(self, products) -> None:
        """Keep the layouts the kernels `products` read (one storage serves every candidate unless it says else)."""


class Dense(Linear):
    """A weight [out, in] in the model's dtype, through the product chosen for the step's row count (`products`, one
    candidate per row bucket); only the layouts those candidates read are held."""

    def __init__(self, w_out_in: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        self.w_out_in = w_out_in.detach().contiguous()  # [out, in]: what `linear` reads
        self.bias = None if bias is None else bias.detach()
        self.shape = torch.Size(w_out_in.shape[::-1])  # (in, out)
        self.dtype, self.device, self.ops = w_out_in.dtype, w_out_in.device, ops  # ops: the native kernels or None
        self.w = self.packed = self.dnn = self.tiles = None  # layouts: in_out's [in, out], MKL's, oneDNN's, fp32_pack's
        self.n = torch.tensor(w_out_in.shape[0])  # outputs, as lab.layers reads them for `fp32_tiles`
        self.size = self.w_out_in  # a tensor of shape [out, in]: where the packed products read their sizes
        self.products = default(self.device, self.dtype)

    @property
    def weight_bytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w_out_in, self.w, self.packed, self.dnn, self.tiles, self.bias) if t is not None]

    @property
    def arithmetic(self) -> str:
        return "fp32" if self.dtype == torch.float32 else str(self.dtype).removeprefix("torch.")

    def lab_args(self, bucket: int) -> tuple:
        name = self.products[bucket]
        weight = {"in_out": self.w, "linear": self.w_out_in, "packed": self.packed, "onednn": self.dnn,
                  "fp32_tiles": self.tiles}[name]
        aux = {"packed": self.size, "fp32_tiles": self.n}.get(name)
        return build.PRODUCTS.index(name), weight, aux, self.bias

    def hold(self, products) -> None:
        """Make the layouts the candidates `products` read and drop the others (the values come from an [out, in] or
        [in, out] layout, so one of them must be held until the last call)."""
        src = self.w_out_in if self.w_out_in is not None else None if self.w is None else self.w.t()
        if src is None and set(products) - set(OPAQUE):
            raise RuntimeError("only packed layouts are held: the weight's values cannot be read back")
        if "in_out" in products and self.w is None:
            self.w = src.t().contiguous()
        if "packed" in products and self.packed is None:
            self.packed = aten.pack(src)
        if "onednn" in products and self.dnn is None:
            self.dnn = aten.reorder(src)
        if "fp32_tiles" in products and self.tiles is None:
            self.tiles = self.ops.fp32_pack(src)
        if "linear" in products and self.w_out_in is None:
            self.w_out_in = src.contiguous()
        self.w = self.w if "in_out" in products else None
        self.packed = self.packed if "packed" in products else None
        self.dnn = self.dnn if "onednn" in products else None
        self.tiles = self.tiles if "fp32_tiles" in products else None
        self.w_out_in = self.w_out_in if "linear" in products else None
        self.size = self.w_out_in if self.w_out_in is not None else self.size.new_zeros(1).expand(self.size.shape)

    def product(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if name == "packed":
            return aten.packed_linear(x, self.packed, self.size, self.bias, residual)
        if name == "onednn":
            return aten.onednn_linear(x, self.dnn, self.size, self.bias, residual)
        if name == "fp32_tiles":
            return self.ops.fp32_tiles_linear(x, self.tiles, self.shape[1], self.bias, residual)
        w = self.w if name == "in_out" else self.w_out_in.t()
        if self.bias is None:
            return x @ w if residual is None else torch.addmm(residual, x, w)
        y = torch.addmm(self.bias, x, w)
        return y if residual is None else y.add_(residual)


class Bf16Dense(Linear):
    """A weight [out, in] in bf16; x rounded to bf16, products summed in fp32, returned in fp32, by the native kernels
    (vdpbf16ps where the CPU has AVX512-BF16: `avx512_bf16`; elsewhere the pairs widened in registers and summed with
    FMA: the same sums), per row bucket the one measured faster (`products`: "bf16", or "bf16_tiles", a group of tiles
    widened into cache once for an fp32 FMA kernel: the same sums too). Without the native kernels the level is
    refused: no other product computes these numbers."""

    def __init__(self, w_out_in: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        if ops is None:
            raise RuntimeError(f"precision bf16 needs the lab's native kernels, not built here: {build.error}")
        caps = build.capabilities()
        self.avx512_bf16, self.isa = caps["bf16_dot"], caps["isa"]
        self.shape = torch.Size(w_out_in.shape[::-1])  # (in, out)
        self.dtype, self.device = torch.float32, w_out_in.device
        self.bias = None if bias is None else bias.detach().float()
        self.n = torch.tensor(w_out_in.shape[0])  # outputs: lab.layers reads them from this tensor
        self.w = ops.bf16_pack(w_out_in.detach())
        self.family, self.candidates = "bf16", ("bf16", "bf16_tiles", "bf16_mm")  # choice.py measures these
        self._ops = {c: getattr(ops, f"{c}_linear") for c in self.candidates}  # looked up once, not per product
        self.products = ["bf16"] * len(BUCKETS)

    @property
    def weight_bytes(self) -> int:
        return self.shape.numel() * 2

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w, self.bias) if t is not None]

    @property
    def arithmetic(self) -> str:
        if self.avx512_bf16:
            return "bf16: pairs summed in fp32 (AVX512-BF16)"
        return f"bf16: pairs widened to fp32, FMA sums ({self.isa})"

    def kernel(self, bucket: int) -> str:
        name = self.products[bucket]
        if name != "bf16":
            return {"bf16_tiles": f"bf16_tiles ({self.isa} FMA)", "bf16_mm": "bf16_mm (ATen GEMM)"}[name]
        return "bf16 (vdpbf16ps)" if self.avx512_bf16 else f"bf16 (widened, {self.isa} FMA)"

    def lab_args(self, bucket: int) -> tuple:
        return build.PRODUCTS.index(self.products[bucket]), self.w, self.n, self.bias

    def product(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._ops[name](x, self.w, self.shape[1], self.bias, residual)


class GgufDense(Linear):
    """A weight [out, in] as GGUF blocks (`fmt`: one of build.GGUF_FORMATS), packed once for the native kernels,
    through the kernel chosen for the step's row count (`products`, per row bucket, measured:
    engine/kernels/choice.py): `fmt` (the blocks dequantized in registers, per row of x), `fmt`_tiles (a group of
    tiles dequantized once into the thread's cache, then an fp32 FMA kernel against every row: faster where the
    products are compute-bound) or `fmt`_mm (the weights dequantized whole for ATen's (MKL's) GEMM: for prefills).
    Parts of different formats (`blocks` and `fmt` tuples, rows one after another) are one product: each part's
    kernel gives its columns (candidates "q5_0+q8_0", "q5_0_tiles+q8_0_tiles"...: the same kernel for every part).
    a8: x quantized to 8 bits per block, integer sums (`fmt`_a8, the one candidate, on blocks packed for it)."""

    def __init__(self, blocks, fmt, in_features: int, ops, bias: torch.Tensor | None = None, a8: bool = False):
        parts = list(zip(blocks, fmt)) if isinstance(fmt, tuple) else [(blocks, fmt)]
        parts = [(np.concatenate([b for b, _ in run]), f)  # neighbours of one format: one part
                 for f, run in ((f, list(run)) for f, run in itertools.groupby(parts, key=lambda p: p[1]))]
        self.fmts, self.fmt, self.ops, self.a8 = tuple(f for _, f in parts), "+".join(f for _, f in parts), ops, a8
        self.bias = None if bias is None else bias.detach().float()
        pack = "_a8_pack" if a8 else "_pack"
        packed = [getattr(ops, f + pack)(torch.from_numpy(np.array(b, copy=True))) for b, f in parts]
        self.packed = packed[0] if len(packed) == 1 else torch.cat([p.flatten() for p in packed])  # one buffer
        self.views, self.columns, offset = [], [0], 0  # each part's packed blocks in it; its first column
        for p in packed:
            self.views.append(self.packed.view(-1)[offset:offset + p.numel()].view(p.shape))
            self.columns.append(self.columns[-1] + p.shape[0])
            offset += p.numel()
        self.shape = torch.Size((in_features, self.columns[-1]))  # (in, out)
        self.dtype, self.device = torch.float32, torch.device("cpu")  # what goes in and comes out
        self.family = self.fmt  # choice.py measures the candidates:
        kinds = ("_a8",) if a8 else ("", "_tiles", "_mm")
        self.candidates = tuple("+".join(f + k for f in self.fmts) for k in kinds)
        self._ops = {c: [getattr(ops, f"{n}_linear") for n in c.split("+")] for c in self.candidates}  # looked up once
        self._tables = {}  # candidate -> lab.layers' table of parts (segments)
        self.products = [self.candidates[0]] * len(BUCKETS)

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.bias) if t is not None]

    @property
    def _fixed_point(self) -> bool:
        return "q4_1" in self.fmts and build.capabilities()["q4_1_vnni"]

    @property
    def arithmetic(self) -> str:
        if self.a8:
            caps = build.capabilities()
            dot = "vpdpbusd" if caps["q4_1_vnni"] else "scalar" if caps["isa"] == "scalar" else "vpmaddubsw"
            return (f"{self.fmt}: x quantized to 8 bits per block as llama.cpp quantizes it, integer sums ({dot}, "
                    f"{caps['isa']}), fp32 scaling")
        parts, own = [], set(self.products)
        if self.candidates[0] in own:
            parts.append("x in 30-bit fixed point per block of 32, exact integer sums (AVX512-VNNI), fp32 scaling"
                         if self._fixed_point else "fp32")
        if own - {self.candidates[0]}:
            parts.append("weights dequantized, fp32 products (tiles or GEMM)")
        return f"{self.fmt}: " + "; ".join(parts)

    def kernel(self, bucket: int) -> str:
        name = self.products[bucket]
        vnni = (name == "q4_1" and self._fixed_point) or (self.a8 and build.capabilities()["q4_1_vnni"])
        return f"{name} (AVX512-VNNI)" if vnni else name

    def lab_args(self, bucket: int) -> tuple:
        name = self.products[bucket]
        if len(self.fmts) == 1:
            return build.PRODUCTS.index(name), self.packed, None, self.bias
        if name not in self._tables:  # per part: its kind, outputs and bytes
            self._tables[name] = torch.tensor([[build.PRODUCTS.index(n), v.shape[0], v.numel()]
                                               for n, v in zip(name.split("+"), self.views)])
        return build.PRODUCTS.index("segments"), self.packed, self._tables[name], self.bias

    def product(self, name: str, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        ops = self._ops[name]
        if len(ops) == 1:
            return ops[0](x, self.packed, self.bias, residual)
        cols = list(zip(self.columns, self.columns[1:]))
        return torch.cat([op(x, w, None if self.bias is None else self.bias[a:b],
                             None if residual is None else residual[:, a:b])
                          for op, w, (a, b) in zip(ops, self.views, cols)], 1)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (an embedding lookup), fp32."""
        return (self.ops.q8_0_a8_rows if self.a8 else self.ops.q8_0_rows)(self.packed, ids)
