"""A GGUF file's linear weights read as stored (engine/model/layers/linear.py's GgufDense multiplies them): rows
in Hugging Face's order (q and k rows un-permuted as transformers' GGUF loader does, where the architecture stores
them permuted: engine/model/support.py's gguf_permuted), q/k/v and gate/up concatenated as the engine's layers hold
them (engine/model/weights.py), parts of different block formats side by side (GgufDense multiplies each in its
own); or every block requantized once to another format (w8a8: Q8_0, gguf's quantization, bit for bit llama.cpp's
reference one, of gguf's dequantized weights: what llama-quantize --allow-requantize writes)."""
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, quants

Q = GGMLQuantizationType
GGUF_KINDS = {Q.Q4_1: "q4_1", Q.Q8_0: "q8_0", Q.Q4_K: "q4_k", Q.Q5_0: "q5_0", Q.Q6_K: "q6_k"}  # the formats read


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's: each head's rows (2, dim/2) interleaved -> (dim/2, 2)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def gguf_layers(path, config, permuted: bool = True, requantize: str | None = None) -> tuple[dict, list[dict]]:
    """({"embed": (blocks, fmt, in)}, per layer {"qkv"|"o"|"gate_up"|"down": (blocks [out, bytes], fmt, in)}) from a
    GGUF file, rows in Hugging Face's order; a concatenated product whose parts differ in format is (the parts'
    blocks, their formats, in) as tuples; requantize: a format of GGUF_KINDS's every block is requantized to. Fails
    naming any tensor stored in a format it does not read."""
    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    to = {v: k for k, v in GGUF_KINDS.items()}.get(requantize)

    def read(name: str, heads: int | None = None):
        if name not in tensors:
            raise ValueError(f"the GGUF file has no tensor {name}")
        t = tensors[name]
        if t.tensor_type not in GGUF_KINDS:
            raise ValueError(f"{name} is stored as {t.tensor_type.name}; precision=w4 reads "
                             f"{[k.name for k in GGUF_KINDS]}")
        blocks = np.asarray(t.data)
        if heads is not None and permuted:
            blocks = _unpermute(blocks, heads)
        if to is not None and t.tensor_type != to:
            return quants.quantize(quants.dequantize(blocks, t.tensor_type), to), requantize, int(t.shape[0])
        return blocks, GGUF_KINDS[t.tensor_type], int(t.shape[0])

    def joined(*parts):
        if len({p[1] for p in parts}) == 1:
            return np.concatenate([p[0] for p in parts]), parts[0][1], parts[0][2]
        return tuple(p[0] for p in parts), tuple(p[1] for p in parts), parts[0][2]

    H, KV = config.num_attention_heads, config.num_key_value_heads
    embed = read("token_embd.weight")
    if embed[1] != "q8_0":
        raise ValueError(f"token_embd.weight is stored as {embed[1].upper()}; precision=w4 reads embedding rows from "
                         "Q8_0 blocks only")
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
