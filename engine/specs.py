"""The engine's configuration records, frozen and checked when made (a bad value fails here, naming the valid ones):
the model to load, the precision level it runs at, the KV cache and the batching policy. pipeline/config.py makes
them from a composed conf/ (where every default is); engine/factory.py builds from them. Also speculative
decoding's record (conf/speculative)."""
import dataclasses
import inspect
from dataclasses import dataclass, field
from types import MappingProxyType

from engine.core.policies import POLICIES

SOURCES = ("random", "gguf", "dir")  # random weights from `config` | a GGUF file of a Python package | a local folder
WEIGHTS = ("model", "bf16", "gguf")  # how the engine stores the weights
ACTIVATIONS = ("float32", "int8")  # what a GGUF level's products multiply its weights' codes with
REQUANTIZE = (None, "q8_0")  # a GGUF level's blocks as stored, or requantized to this format
DTYPES = ("float32", "bfloat16", "float16")  # a Hugging Face model's dtype
KV_DTYPES = ("float32", "bfloat16")  # the KV cache's
KV_NAMES = ("slot", "cat", "paged")
SPEC_METHODS = ("none", "ngram", "draft")  # no speculation | prompt lookup | a draft model's greedy tokens


def _refuse(what: str, value, valid) -> None:
    raise ValueError(f"{what} = {value!r}: choose one of {list(valid)}")


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str                      # one of SOURCES
    config: dict | None = None       # random: the Hugging Face config's fields (model_type first among them)
    seed: int = 0                    # random: the weights' seed
    path: str | None = None          # gguf, dir: the model's folder
    package: str | None = None       # gguf: the Python package that ships the file
    gguf_file: str | None = None     # gguf: the file's name in that package
    tokenizer: str | None = None     # random: a tokenizer folder, else none (prompts are token ids)
    chat_template: str | None = None  # gguf: Jinja, where the file has none
    eos_token_id: int | tuple | None = None  # gguf: generation's end-of-sequence ids, where the file has none

    def __post_init__(self):
        if self.source not in SOURCES:
            _refuse(f"model {self.name}: source", self.source, SOURCES)
        need = {"random": ("config",), "gguf": ("path", "package", "gguf_file"), "dir": ("path",)}[self.source]
        missing = [f for f in need if getattr(self, f) is None]
        if missing:
            raise ValueError(f"model {self.name} (source {self.source}) needs {missing}")


@dataclass(frozen=True)
class PrecisionSpec:
    """A precision level; the defaults are the model as loaded (no level): its own weights, dtype and KV dtype."""
    name: str = "model"
    weights: str = "model"           # one of WEIGHTS
    dtype: str = "float32"           # the Hugging Face model's, loaded
    kv_dtype: str | None = None      # one of KV_DTYPES; None: the activations' dtype
    device: str = "cpu"
    compute: str | None = None       # what the products multiply and sum in (reports)
    activations: str = "float32"     # one of ACTIVATIONS: int8, x quantized per block as llama.cpp does (gguf)
    requantize: str | None = None    # one of REQUANTIZE: the GGUF file's blocks requantized once at load (gguf)
    lossy: bool = False              # the level changes values of the model
    compile: bool = False            # decode-only steps through torch.compile
    graphs: bool = False             # those steps padded to few shapes (CUDA graphs on CUDA)
    reference_dtype: str | None = None  # generate's dtype in the speed comparisons; None: dtype

    def __post_init__(self):
        for what, value, valid in (("weights", self.weights, WEIGHTS), ("dtype", self.dtype, DTYPES),
                                   ("kv_dtype", self.kv_dtype, (None, *KV_DTYPES)),
                                   ("activations", self.activations, ACTIVATIONS),
                                   ("requantize", self.requantize, REQUANTIZE)):
            if value not in valid:
                _refuse(f"precision {self.name}: {what}", value, [v for v in valid if v])
        if (self.activations != "float32" or self.requantize) and self.weights != "gguf":
            raise ValueError(f"precision {self.name}: activations {self.activations} and requantize "
                             f"{self.requantize} act on GGUF blocks; weights is {self.weights!r}, not 'gguf'")


@dataclass(frozen=True)
class KVSpec:
    name: str = "slot"               # one of KV_NAMES
    block_size: int | None = None    # paged: tokens per block
    num_blocks: int | None = None    # paged: blocks in the pool; None: from memory_mb
    memory_mb: float | None = None   # paged: MiB of K/V; both None: the slot cache's size
    watermark: float | None = None   # paged: fraction of the blocks admission leaves free
    prefix_caching: bool | None = None  # paged: reuse cached full blocks of an equal prefix

    def entry(self) -> dict:
        """The conf/kv entry this record is (the fields it sets)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}

    def __post_init__(self):
        if self.name not in KV_NAMES:
            _refuse("kv", self.name, KV_NAMES)
        if self.name != "paged":
            return
        bs, n, mb, wm = self.block_size, self.num_blocks, self.memory_mb, self.watermark
        valid = {"block_size": (isinstance(bs, int) and bs >= 1, "an integer >= 1 (tokens)"),
                 "num_blocks": (n is None or (isinstance(n, int) and n >= 2), "null or an integer >= 2"),
                 "memory_mb": (mb is None or (isinstance(mb, (int, float)) and mb > 0), "null or > 0 (MiB)"),
                 "watermark": (isinstance(wm, (int, float)) and 0 <= wm < 1, "in [0, 1) (a fraction of the blocks)"),
                 "prefix_caching": (isinstance(self.prefix_caching, bool), "true or false")}
        for name, (ok, rule) in valid.items():
            if not ok:
                raise ValueError(f"kv.{name} = {getattr(self, name)!r}: must be {rule}")


@dataclass(frozen=True)
class PolicySpec:
    name: str                        # one of engine.core.policies.POLICIES
    max_running: int                 # requests running at once
    knobs: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # the policy's own, all given

    def __post_init__(self):
        if self.name not in POLICIES:
            _refuse("policy", self.name, sorted(POLICIES))
        if not isinstance(self.max_running, int) or self.max_running < 1:
            raise ValueError(f"policy {self.name}: max_running = {self.max_running!r}: must be an integer >= 1")
        object.__setattr__(self, "knobs", MappingProxyType(dict(self.knobs)))
        params = inspect.signature(POLICIES[self.name].__init__).parameters.values()
        own = {p.name: p for p in params if p.kind is p.KEYWORD_ONLY}
        if set(self.knobs) - set(own):
            raise ValueError(f"policy {self.name!r} has no knob {sorted(set(self.knobs) - set(own))}; "
                             f"it has {sorted(own)}")
        missing = [n for n, p in own.items() if p.default is p.empty and n not in self.knobs]
        if missing:
            raise ValueError(f"policy {self.name!r} needs {missing}")

    def entry(self) -> dict:
        """The conf/policy entry this record is."""
        return {"name": self.name, "max_running": self.max_running, **self.knobs}

    @classmethod
    def of(cls, name: str, max_running: int, **knobs) -> "PolicySpec":
        return cls(name, int(max_running), MappingProxyType(knobs))


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding, vLLM's `speculative_config` fields (engine/core/speculation.py)."""
    method: str = "none"             # one of SPEC_METHODS
    num_speculative_tokens: int = 4  # k: the most tokens drafted per row and step
    prompt_lookup_min: int = 2       # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4       # ngram: the longest
    adaptive: bool = False           # choose k in [0, num_speculative_tokens] each step from the cost model
    cost_model: str | None = None    # adaptive: a fitted step-time model's JSON (the pipeline's cost_model.json)
    draft_model: str | None = None   # draft: a conf/model name with the target's vocabulary

    def __post_init__(self):
        if self.method not in SPEC_METHODS:
            _refuse("speculative.method", self.method, SPEC_METHODS)
        k, lo, hi = self.num_speculative_tokens, self.prompt_lookup_min, self.prompt_lookup_max
        valid = {"num_speculative_tokens": (isinstance(k, int) and k >= 1, "an integer >= 1"),
                 "prompt_lookup_min": (isinstance(lo, int) and lo >= 1, "an integer >= 1"),
                 "prompt_lookup_max": (isinstance(hi, int) and hi >= lo, "an integer >= prompt_lookup_min"),
                 "adaptive": (isinstance(self.adaptive, bool), "true or false"),
                 "draft_model": ((self.method == "draft") == (self.draft_model is not None),
                                 "a conf/model name exactly when method is draft")}
        for name, (ok, rule) in valid.items():
            if not ok:
                raise ValueError(f"speculative.{name} = {getattr(self, name)!r}: must be {rule}")
