"""The lab's configuration: conf/ composed by Hydra (a bad option fails here, listing the valid ones), each group's
defaults read from its file (conf/ holds every default), and the engine's records (engine/specs.py) made from it."""
import copy
import dataclasses
import functools
import json
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from engine.core.policies import make_scheduler
from engine.core.simulator import CostModel
from engine.specs import KVSpec, ModelSpec, PolicySpec, PrecisionSpec, SpeculativeSpec

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose_config(overrides=()) -> DictConfig:
    """conf/config.yaml with Hydra overrides; a precision level the model cannot run fails here too. Hydra's own
    order: the group choices make the defaults tree (composed once per process for each set of choices: a quarter
    second of YAML each time), then the value overrides are applied to a copy, as Hydra applies them."""
    parsed = OverridesParser.create().parse_overrides(list(overrides))
    chosen = [o for o in parsed if (CONF / o.key_or_group).is_dir() and not isinstance(o.value(), dict)]
    cfg = copy.deepcopy(_composed(tuple(o.input_line for o in chosen)))
    ConfigLoaderImpl._apply_overrides_to_config([o for o in parsed if o not in chosen], cfg)
    check(cfg)
    return cfg


@functools.lru_cache(maxsize=64)
def _composed(choices: tuple[str, ...]) -> DictConfig:
    """conf/config.yaml composed by Hydra with these group choices (callers copy it)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(choices))


def check(cfg) -> None:
    """Make every record a composed config holds (model, precision, policy, KV): a bad value fails here, naming the
    valid ones, before any stage works; a precision level the model cannot run fails too."""
    _check_storage(cfg)
    model_spec(cfg.model)
    precision_spec(cfg.precision)
    if "policy" in cfg:  # its knobs' values are checked by the scheduler they make
        scheduler = make_scheduler(policy_spec(cfg.policy), int(cfg.get("max_request_tokens", 1)))
        if "speculative" in cfg and speculative_spec(cfg.speculative).method != "none":
            scheduler.use_speculation(None)  # a request-level policy refuses, naming the ones that speculate
    if "kv" in cfg:
        kv_spec(cfg.kv)


def _check_storage(cfg) -> None:
    """A level that reads a model's GGUF file (precision.weights: gguf) needs a model that has one: else a ValueError
    naming the models that do and the levels this one can run."""
    if cfg.precision.get("weights") == "gguf" and cfg.model.get("source") != "gguf":
        gguf = [m for m in options("model") if group_entry("model", m).get("source") == "gguf"]
        levels = [p for p in options("precision") if group_entry("precision", p).get("weights") != "gguf"]
        raise ValueError(f"precision={cfg.precision.name} reads a model's GGUF file; model {cfg.model.name} has none "
                         f"(model.source is not gguf): choose a model of {gguf} or a precision of {levels}")


def options(group: str) -> list[str]:
    """The choices of a config group: its files' names."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def group_entry(group: str, name: str) -> dict:
    """conf/<group>/<name>.yaml as a plain dict; an unknown name fails listing the choices."""
    path = CONF / group / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"unknown {group} {name!r}; choose one of {options(group)}")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def policy_spec(policy, **given) -> PolicySpec:
    """A policy record from a conf/policy entry (a mapping with its name, or just the name, and knobs `given`; a
    record is returned as it is), every knob not given taken from conf/policy/<name>.yaml (the one place of
    defaults); a bad name or knob fails naming the valid ones."""
    if isinstance(policy, PolicySpec) and not given:
        return policy
    knobs = _completed("policy", policy, given, "knob")
    return PolicySpec.of(knobs.pop("name"), knobs.pop("max_running"), **knobs)


def kv_spec(kv, **given) -> KVSpec:
    """A KV record from a conf/kv entry (or just its name; a record is returned as it is) with every field, its
    defaults from conf/kv/<name>.yaml; a bad name, field or value fails naming the valid ones."""
    if isinstance(kv, KVSpec) and not given:
        return kv
    return KVSpec(**_completed("kv", kv, given, "field"))


def speculative_spec(speculative, **given) -> SpeculativeSpec:
    """Speculative decoding's record from a conf/speculative entry (or its method's name), its defaults from
    conf/speculative/<method>.yaml; a bad method, field or value fails naming the valid ones."""
    if isinstance(speculative, SpeculativeSpec) and not given:
        return speculative
    return SpeculativeSpec(**_completed("speculative", speculative, given, "field", key="method"))


def speculation(cfg, vocab_size: int):
    """The engine's speculative decoding for a composed config (None for method none): the draft model loaded by
    its conf/model name, the fitted cost model read for adaptive k (a missing file fails naming the stage that
    writes it)."""
    from engine import factory

    spec = speculative_spec(cfg.speculative)
    draft = factory.load_source(model_spec(spec.draft_model))[0] if spec.method == "draft" else None
    cost = None
    if spec.adaptive:
        path = ROOT / spec.cost_model
        if not path.exists():
            raise ValueError(f"speculative.adaptive reads a fitted step-time model: {path} is missing (dvc repro "
                             "fit_cost_model writes it; or give speculative.cost_model)")
        cost = CostModel(**json.loads(path.read_text())["cost_model"])
    return factory.build_speculation(spec, vocab_size, draft, cost)


def _completed(group: str, entry, given: dict, what: str, key: str = "name") -> dict:
    """A conf/<group> entry (a mapping, or its `key`: the file's name) with `given` on top, every key not set taken
    from conf/<group>/<that name>.yaml; a key that file lacks fails naming the ones it has."""
    entry = {**({key: entry} if isinstance(entry, str) else _plain(entry)), **given}
    full = group_entry(group, entry.get(key))
    if set(entry) - set(full):
        raise ValueError(f"{group} {full[key]!r} has no {what} {sorted(set(entry) - set(full))}; it has "
                         f"{sorted(full)}")
    return {**full, **entry}


def precision_spec(precision) -> PrecisionSpec:
    """The record of a precision level: a composed config's `precision`, or a conf/precision name."""
    entry = group_entry("precision", precision) if isinstance(precision, str) else _plain(precision)
    return _record(PrecisionSpec, entry, "precision")


def model_spec(model) -> ModelSpec:
    """The record of a model: a composed config's `model`, or a conf/model name."""
    entry = group_entry("model", model) if isinstance(model, str) else _plain(model)
    if isinstance(entry.get("eos_token_id"), list):
        entry["eos_token_id"] = tuple(entry["eos_token_id"])
    return _record(ModelSpec, entry, "model")


def _record(cls, entry: dict, group: str):
    """cls(**entry); a field the record does not have fails naming the ones it has."""
    fields = {f.name for f in dataclasses.fields(cls)}
    if set(entry) - fields:
        raise ValueError(f"{group} {entry.get('name')!r} has no field {sorted(set(entry) - fields)}; it has "
                         f"{sorted(fields)}")
    return cls(**entry)


def _plain(node) -> dict:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)


def build_net(source, cfg, **options):
    """The engine's model of a loaded Hugging Face model `source` at a composed config's precision (the GGUF file of
    a level that reads one found from its model). options: engine.factory.build_net's."""
    from engine import factory  # torch and transformers only where a model is built

    level = precision_spec(cfg.precision)
    return factory.build_net(source, level, factory.gguf_file(model_spec(cfg.model), level), **options)


def load_net(cfg, **build):
    """(the engine's model at the configured precision, tokenizer or None) for a composed config: the weights taken
    from the Hugging Face model (or its GGUF file) into the engine's layout (engine/factory.py)."""
    from engine import factory

    return factory.load_net(model_spec(cfg.model), precision_spec(cfg.precision), **build)


def load_source(cfg, reference: bool = False):
    """(Hugging Face model, tokenizer or None) for a composed config, in its precision's dtype (reference: the dtype
    generate is compared in, `reference_dtype`)."""
    from engine import factory

    return factory.load_source(model_spec(cfg.model), precision_spec(cfg.precision), reference)
