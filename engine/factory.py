"""The one place the engine's parts are built, from records (engine/specs.py): the Hugging Face source model, the
engine's model of it at a precision level (its architecture's class, engine/model/models/; the native kernels and
each product's kernel chosen as explicit steps), and an engine over it (policy, KV cache, limits, speculation)."""
import time
from pathlib import Path

import torch

from engine.core.speculation import NgramDrafter, Speculation
from engine.engine import LLMEngine
from engine.kernels import build
from engine.model import loader
from engine.model.draft import DraftModel
from engine.model.forward import FlatModel
from engine.model.models import architecture
from engine.specs import KVSpec, ModelSpec, PolicySpec, PrecisionSpec, SpeculativeSpec

AS_LOADED = PrecisionSpec()  # no level: the model's own weights, dtype and KV dtype
SLOT = KVSpec()


def load_source(model: ModelSpec, precision: PrecisionSpec = AS_LOADED, reference: bool = False):
    """(Hugging Face model, tokenizer or None) in the level's dtype on its device (reference: the dtype generate is
    compared in, `reference_dtype`)."""
    dtype = (precision.reference_dtype or precision.dtype) if reference else precision.dtype
    return loader.load_model(model, dtype, precision.device)


def gguf_file(model: ModelSpec, precision: PrecisionSpec) -> Path | None:
    """The GGUF file a level that reads one (weights "gguf") takes its blocks from; None for other levels."""
    if precision.weights != "gguf":
        return None
    if model.source != "gguf":
        raise ValueError(f"precision={precision.name} reads a model's GGUF file; model {model.name} has none "
                         "(source is not gguf)")
    return loader.gguf_path(model.package, model.gguf_file)


def native_ops(hf_model, precision: PrecisionSpec, native_kernels: bool = True):
    """The native kernels where the steps run fp32 on a CPU and they build, else None (the reason in build.error)."""
    weight = hf_model.model.embed_tokens.weight
    fp32 = weight.dtype == torch.float32 or precision.weights != "model"  # other storages keep fp32 activations
    return build.ops() if native_kernels and weight.device.type == "cpu" and fp32 else None


def build_net(hf_model, precision: PrecisionSpec = AS_LOADED, gguf: Path | None = None, *, take: bool = False,
              kernel: str | None = None, remeasure: bool = False, native_kernels: bool = True) -> FlatModel:
    """The engine's model of a Hugging Face model at a level: its architecture's class (a config it would not
    reproduce is refused by name), the native kernels (native_kernels=False: ATen's operators), then each product's
    kernel: `kernel` for all, else each shape's measured choice (`remeasure`: measured again). take: the Hugging Face
    model gives up its weights (it cannot run afterwards); gguf: the file of a level that reads one."""
    arch = architecture(hf_model)
    if precision.weights == "gguf" and gguf is None:
        raise ValueError(f"precision={precision.name} reads a GGUF file: give its path (engine.factory.gguf_file)")
    net = arch(hf_model, native_ops(hf_model, precision, native_kernels), precision, gguf, take)
    net.choose_kernels(kernel, remeasure)
    return net


def load_net(model: ModelSpec, precision: PrecisionSpec, **options) -> tuple[FlatModel, object]:
    """(the engine's model at `precision`, tokenizer or None): the weights taken from the Hugging Face model (or its
    GGUF file) into the engine's layout, so they exist once. options: build_net's."""
    source, tokenizer = load_source(model, precision)
    return build_net(source, precision, gguf_file(model, precision), take=True, **options), tokenizer


def build_speculation(spec: SpeculativeSpec, vocab_size: int, draft=None, cost=None) -> Speculation | None:
    """Speculative decoding as a record asks (None for method none): prompt lookup, or `draft` (a Hugging Face model
    with the target's vocabulary of vocab_size ids); cost: the step-time model adaptive k needs."""
    if spec.method == "none":
        return None
    drafter = (NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram"
               else DraftModel(draft, vocab_size))
    return Speculation(drafter, spec.num_speculative_tokens, spec.adaptive, cost)


def build_engine(model, policy: PolicySpec, max_request_tokens: int, eos_ids=(), *, kv: KVSpec = SLOT,
                 seed: int = 0, clock=time.perf_counter, runner=None, compile: bool | None = None,
                 graphs: bool | None = None, speculation: Speculation | None = None) -> LLMEngine:
    """An engine over `model` (the engine's model; a Hugging Face model is built as it is), or over a ready `runner`
    (the simulator's; model None). compile, graphs: the model's level's unless given; speculation:
    build_speculation's."""
    net = model if model is None or isinstance(model, FlatModel) else build_net(model)
    level = net.precision if net is not None else AS_LOADED
    return LLMEngine(net, policy, max_request_tokens, kv=kv, eos_ids=eos_ids, seed=seed, clock=clock, runner=runner,
                     compile=level.compile if compile is None else compile,
                     graphs=level.graphs if graphs is None else graphs, speculation=speculation)
