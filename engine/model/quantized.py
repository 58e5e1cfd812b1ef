"""Weights held below fp32, each a drop-in for kernels.Dense (y = x W^T (+ bias) (+ residual), fp32 in and out):

GgufDense: a GGUF file's Q4_1 or Q8_0 blocks as stored, products by the fused kernels (engine/kernels/csrc/quant.cpp), which
  dequantize in registers (d * q + m, the very values the fp32 copy holds) and sum in fp32; on a CPU with AVX512-VNNI
  Q4_1 sums each block's codes times x exactly in integers, x in 30-bit fixed point per block of 32 (`arithmetic`).
Bf16Dense: bf16 weights; activations rounded to bf16, products summed in fp32 (engine/kernels/csrc/bf16.cpp on AVX512-BF16).

gguf_layers reads a llama-family GGUF file's linear weights as stored, rows in Hugging Face's order (q and k rows
un-permuted as transformers' GGUF loader does), q/k/v and gate/up concatenated as the engine fuses them.
"""
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

GGUF_KINDS = {GGMLQuantizationType.Q4_1: "q4_1", GGMLQuantizationType.Q8_0: "q8_0"}  # the block formats read


class GgufDense:
    """A weight [out, in] as GGUF blocks (`fmt`: "q4_1" or "q8_0"), packed once for the fused kernels."""

    def __init__(self, blocks: np.ndarray, fmt: str, in_features: int, ops, bias: torch.Tensor | None = None):
        self.fmt, self.ops, self.bias = fmt, ops, None if bias is None else bias.detach().float()
        self.packed = getattr(ops, f"{fmt}_pack")(torch.from_numpy(np.array(blocks, copy=True)))
        self.shape = torch.Size((in_features, blocks.shape[0]))  # (in, out)
        self.dtype, self.device = torch.float32, torch.device("cpu")  # what goes in and comes out
        self._linear = getattr(ops, f"{fmt}_linear")

    @property
    def weight_bytes(self) -> int:
        return self.packed.nbytes

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.bias) if t is not None]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self._linear(x, self.packed, self.bias, residual)

    @property
    def arithmetic(self) -> str:
        """How this product computes on this machine."""
        if self.fmt == "q4_1" and self.ops.q4_1_fixed_point():
            return "q4_1: x in 30-bit fixed point per block of 32, exact integer sums (AVX512-VNNI), fp32 scaling"
        return f"{self.fmt}: fp32"

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The dequantized rows `ids` (an embedding lookup), fp32."""
        return self.ops.q8_0_rows(self.packed, ids)


class Bf16Dense:
    """A weight [out, in] in bf16; x rounded to bf16, products summed in fp32, returned in fp32: the fused kernel
    (engine/kernels/csrc/bf16.cpp) where the CPU has AVX512-BF16 (`native`), else torch's bf16 product (its output rounded to
    bf16 too: the stated fallback)."""

    def __init__(self, w_out_in: torch.Tensor, bias: torch.Tensor | None = None, ops=None):
        self.native = ops is not None and ops.bf16_native()
        self.shape = torch.Size(w_out_in.shape[::-1])  # (in, out)
        self.dtype, self.device = torch.float32, w_out_in.device
        self.bias = None if bias is None else bias.detach().float()
        self.ops, self.n = ops, torch.tensor(w_out_in.shape[0])  # outputs: lab.layers reads them from this tensor
        self.w = ops.bf16_pack(w_out_in.detach()) if self.native else w_out_in.detach().to(torch.bfloat16)

    @property
    def weight_bytes(self) -> int:
        return self.shape.numel() * 2

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.w, self.bias) if t is not None]

    @property
    def arithmetic(self) -> str:
        return "bf16: pairs summed in fp32 (AVX512-BF16)" if self.native else "bf16: torch's product, rounded to bf16"

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.native:
            return self.ops.bf16_linear(x, self.w, self.shape[1], self.bias, residual)
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.w).float()
        y = y if self.bias is None else y.add_(self.bias)
        return y if residual is None else y.add_(residual)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's: each head's rows (2, dim/2) interleaved -> (dim/2, 2)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def gguf_layers(path, config) -> tuple[dict, list[dict]]:
    """({"embed": (blocks, fmt, in)}, per layer {"qkv"|"o"|"gate_up"|"down": (blocks [out, bytes], fmt, in)}) from a
    GGUF file, rows in Hugging Face's order; fails naming any tensor stored in a format it does not read."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}

    def read(name: str, heads: int | None = None):
        if name not in tensors:
            raise ValueError(f"the GGUF file has no tensor {name}")
        t = tensors[name]
        if t.tensor_type not in GGUF_KINDS:
            raise ValueError(f"{name} is stored as {t.tensor_type.name}; precision=w4 reads "
                             f"{[k.name for k in GGUF_KINDS]}")
        blocks = np.asarray(t.data)
        return (blocks if heads is None else _unpermute(blocks, heads)), GGUF_KINDS[t.tensor_type], int(t.shape[0])

    def joined(*parts):
        fmts = {p[1] for p in parts}
        if len(fmts) != 1:
            raise ValueError(f"weights fused into one product have different formats {sorted(fmts)}")
        return np.concatenate([p[0] for p in parts]), parts[0][1], parts[0][2]

    H, KV = config.num_attention_heads, config.num_key_value_heads
    embed = read("token_embd.weight")
    if "output.weight" in tensors:
        raise ValueError("the GGUF file has an untied output head; precision=w4 reads tied embeddings only")
    layers = []
    for i in range(config.num_hidden_layers):
        b = f"blk.{i}."
        layers.append({"qkv": joined(read(b + "attn_q.weight", H), read(b + "attn_k.weight", KV),
                                     read(b + "attn_v.weight")),
                       "o": read(b + "attn_output.weight"),
                       "gate_up": joined(read(b + "ffn_gate.weight"), read(b + "ffn_up.weight")),
                       "down": read(b + "ffn_down.weight")})
    return {"embed": embed}, layers
