"""The lab's configuration: conf/ composed by Hydra (a bad option fails here, listing the valid ones), each group's
defaults read from its file (conf/ holds every default), and the model a composed config names."""
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from engine import threads

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def compose_config(overrides=()) -> DictConfig:
    """conf/config.yaml with Hydra overrides; a precision level the model cannot run fails here too."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    _check_storage(cfg)
    return cfg


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


def policy_config(policy) -> dict:
    """A conf/policy entry ({name, max_running, ...its knobs}) with every knob, the ones not given taken from
    conf/policy/<name>.yaml (the one place of defaults); a bad name or knob fails naming the valid ones."""
    given = dict(policy)
    full = group_entry("policy", given.get("name"))
    if set(given) - set(full):
        raise ValueError(f"policy {full['name']!r} has no knob {sorted(set(given) - set(full))}; it has {sorted(full)}")
    return {**full, **given}


def kv_config(kv) -> dict:
    """A conf/kv entry (or just its name) with every field, its defaults from conf/kv/<name>.yaml; a bad name,
    field or value fails naming the valid ones."""
    kv = {"name": kv} if isinstance(kv, str) else dict(kv)
    full = group_entry("kv", kv.get("name"))
    if set(kv) - set(full):
        raise ValueError(f"kv {full['name']!r} has no field {sorted(set(kv) - set(full))}; it has {sorted(full)}")
    kv = {**full, **kv}
    if kv["name"] == "paged":
        bs, n, mb, wm = kv["block_size"], kv["num_blocks"], kv["memory_mb"], kv["watermark"]
        valid = {"block_size": (isinstance(bs, int) and bs >= 1, "an integer >= 1 (tokens)"),
                 "num_blocks": (n is None or (isinstance(n, int) and n >= 2), "null or an integer >= 2"),
                 "memory_mb": (mb is None or (isinstance(mb, (int, float)) and mb > 0), "null or > 0 (MiB)"),
                 "watermark": (isinstance(wm, (int, float)) and 0 <= wm < 1, "in [0, 1) (a fraction of the blocks)"),
                 "prefix_caching": (isinstance(kv["prefix_caching"], bool), "true or false")}
        for name, (ok, rule) in valid.items():
            if not ok:
                raise ValueError(f"kv.{name} = {kv[name]!r}: must be {rule}")
    return kv


def load_configured_model(cfg):
    """(Hugging Face model, tokenizer or None) for a composed config; the engine's steps then run on up to
    cfg.threads CPU threads, fewer while other processes keep cores busy (engine/threads.py)."""
    from engine.model.loader import load_model

    threads.govern(int(cfg.threads), cfg.measure)
    return load_model(cfg.model, cfg.precision.dtype, cfg.precision.device)


def engine_weights(cfg) -> dict:
    """FlatModel's storage arguments for a composed config's precision level: {"weights", "kv_dtype", "gguf"}."""
    weights = cfg.precision.get("weights", "model")
    storage = {"weights": weights, "kv_dtype": cfg.precision.get("kv_dtype")}
    if weights != "gguf":
        return storage
    _check_storage(cfg)
    from engine.model.loader import gguf_path

    return {**storage, "gguf": gguf_path(cfg.model.package, cfg.model.gguf_file)}


def load_engine_model(cfg):
    """(the engine's FlatModel at the configured precision, tokenizer or None): the weights taken from the Hugging
    Face model (or its GGUF file) into the engine's layout, so they exist once (that model can no longer run)."""
    from engine.model.forward import FlatModel

    model, tokenizer = load_configured_model(cfg)
    return FlatModel(model, take=True, **engine_weights(cfg)), tokenizer


def load_reference_model(cfg):
    """(Hugging Face model, tokenizer) in the dtype the precision level is compared against (reference_dtype)."""
    from engine.model.loader import load_model

    threads.govern(int(cfg.threads), cfg.measure)
    return load_model(cfg.model, cfg.precision.get("reference_dtype", cfg.precision.dtype), cfg.precision.device)
