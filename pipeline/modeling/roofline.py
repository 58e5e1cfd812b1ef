"""Step time from first principles: what a step moves (the weights once, each row's K/V read and its new K/V written)
and what it computes (2 FLOP per weight per token through the layers and, for the rows that sample, the LM head;
attention 4 FLOP per query-key pair per head dimension, causal within a prompt chunk), each operator class against the
hardware's memory and compute roofs: an operator class costs its compute time plus its memory time (no overlap: near
the ridge point the published runs of reports/gpu_validation.md take about the sum, not the larger of the two), the
classes summed, plus a fixed cost per step. Its efficiency terms are the ones any real
engine has: the achieved fraction of the memory bandwidth, of the dense matrix rate, seconds per step spent outside
both (launches, scheduling, sampling) and, split over devices, seconds per all-reduce besides its bytes. Tensor
parallelism splits weights, K/V heads and FLOPs over `tp` devices and adds two all-reduces of the step's activations
per layer over the interconnect (a ring: 2 (tp - 1) / tp of the bytes each way). An engine whose decode attention
kernel loads a K/V head once for each query head it serves (TensorRT-LLM's masked MHA before its XQA kernel) reads
heads / kv_heads times the K/V of a decode row.

Used wherever a step's time is computed and not measured: SimRunner takes a Roofline as its cost (step_time(plan)),
so the real scheduler runs on a virtual clock at the speed of hardware this machine is not.
"""
import collections
import functools
from dataclasses import dataclass

from engine.core.outputs import SchedulerOutput

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
GB = 1e9


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shape, from its Hugging Face config (conf/model's `config` or config.json)."""
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    windows: tuple[int | None, ...]          # per layer: its attention window in tokens (None: the whole context)

    @classmethod
    def of(cls, config: dict) -> "Shape":
        c = dict(config)
        layers, heads = int(c["num_hidden_layers"]), int(c["num_attention_heads"])
        window = c.get("sliding_window")
        types = c.get("layer_types") or (["sliding_attention"] * layers if window else ["full_attention"] * layers)
        return cls(layers, int(c["hidden_size"]), heads, int(c.get("num_key_value_heads") or heads),
                   int(c.get("head_dim") or c["hidden_size"] // heads), int(c["intermediate_size"]),
                   int(c["vocab_size"]), bool(c.get("tie_word_embeddings", False)),
                   tuple(int(window) if t == "sliding_attention" and window else None for t in types))

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrix products: q, k, v, o and the gated MLP's three."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        return self.hidden * self.vocab

    @property
    def params(self) -> int:
        """Every weight: layers, embedding, LM head (once if tied) and norms."""
        return (self.layers * (self.layer_params + 2 * self.hidden) + self.hidden
                + self.head_params * (1 if self.tied else 2))

    def kv_elements(self, context: int) -> int:
        """K and V elements a sequence of `context` tokens holds, over all layers (a window caps its layers)."""
        full, windowed = self._window_counts
        return 2 * self.kv_heads * self.head_dim * (full * context + sum(n * min(context, w) for w, n in windowed))

    @functools.cached_property
    def _window_counts(self) -> tuple[int, tuple[tuple[int, int], ...]]:
        """(layers attending the whole context, (window, layers) for the others)."""
        counts = collections.Counter(self.windows)
        return counts.pop(None, 0), tuple(counts.items())

    def kv_elements_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim * self.layers


@dataclass(frozen=True)
class Efficiency:
    bandwidth: float = 1.0    # achieved fraction of the memory bandwidth
    matrix: float = 1.0       # achieved fraction of the dense matrix rate
    step_s: float = 0.0       # s per step outside both roofs
    allreduce_s: float = 0.0  # s per all-reduce besides its bytes (tp > 1: launch and synchronisation)


@dataclass(frozen=True)
class Roofline:
    shape: Shape
    bandwidth: float          # B/s of one device
    rate: float               # dense FLOP/s of one device at the precision's compute type
    weight_bytes: float       # bytes per weight (2 for bf16; a GGUF file's bytes / its weights)
    kv_bytes: float           # bytes per K/V element
    eff: Efficiency = Efficiency()
    tp: int = 1               # devices a step is split over
    link: float = 0.0         # B/s each way between two devices (tp > 1)
    act_bytes: float = 2.0    # bytes per activation element crossing the interconnect
    kv_per_query_head: bool = False  # decode attention loads each K/V head once per query head (no GQA sharing)

    def _roof(self, flops: float, moved: float) -> tuple[float, str]:
        compute = flops / (self.rate * self.eff.matrix)
        memory = moved / (self.bandwidth * self.eff.bandwidth)
        return compute + memory, "compute" if compute > memory else "memory"

    def parts(self, chunks) -> dict:
        """Per operator class, for one step of `chunks` (rows of (new tokens, tokens before them, samples?[, how many
        such rows]), on each device): FLOPs, bytes moved, seconds and the roof that binds."""
        s, tp = self.shape, self.tp
        tokens = sampled = pairs = kv = 0
        for n, past, sample, *count in chunks:
            k = count[0] if count else 1
            tokens += k * n
            sampled += k * bool(sample)
            pairs += k * n * (past + (n + 1) / 2)  # causal query-key pairs per head and layer
            kv += k * s.kv_elements(past + n) * (s.heads // s.kv_heads if self.kv_per_query_head and n == 1 else 1)
        out = {}
        if tokens:
            weights = s.layers * s.layer_params
            out["layers"] = (2 * weights * tokens / tp, weights * self.weight_bytes / tp)
        if sampled:
            out["lm_head"] = (2 * s.head_params * sampled / tp, s.head_params * self.weight_bytes / tp)
        if tokens:
            out["attention"] = (4 * s.head_dim * s.heads * s.layers * pairs / tp, kv * self.kv_bytes / tp)
        res = {k: {"flops": f, "bytes": b, "seconds": (r := self._roof(f, b))[0], "bound": r[1]}
               for k, (f, b) in out.items()}
        if tp > 1 and tokens:
            moved = 2 * s.layers * tokens * s.hidden * self.act_bytes  # two all-reduces per layer
            res["all_reduce"] = {"flops": 0.0, "bytes": moved, "bound": "interconnect",
                                 "seconds": 2 * s.layers * self.eff.allreduce_s + 2 * (tp - 1) / tp * moved / self.link}
        res["fixed"] = {"flops": 0.0, "bytes": 0.0, "seconds": self.eff.step_s if chunks else 0.0, "bound": "fixed"}
        return res

    def seconds(self, chunks) -> float:
        return sum(p["seconds"] for p in self.parts(chunks).values())

    def step_time(self, plan: SchedulerOutput) -> float:
        """Seconds of one scheduled step (SimRunner's cost interface): its decode rows grouped by context first."""
        rows: dict[tuple, int] = {}
        for c in plan.chunks:
            key = (len(c.tokens), c.start, c.sample)
            rows[key] = rows.get(key, 0) + 1
        return self.seconds([(*key, k) for key, k in rows.items()])

    def weights_bytes(self) -> float:
        """Bytes of every weight on one device."""
        return self.shape.params * self.weight_bytes / self.tp

    def kv_bytes_per_token(self) -> float:
        """Bytes of K/V one token holds on one device."""
        return self.shape.kv_elements_per_token() * self.kv_bytes / self.tp
