"""A stage's config: params.yaml (composed from conf/ by DVC) when run without arguments, as DVC runs stages;
else conf/ composed with the Hydra overrides given. Either way a precision level the model cannot run fails here
(params.yaml may have been edited since it was composed: `dvc exp run -S` sets its keys one by one, and so may a
hand), as does a key of params.yaml that conf/ gives but it lacks or holds a value of another kind (check_kinds); the
process then runs under its isa level (pipeline/isa.py: executed again with the level's environment where it
differs)."""
import sys

from omegaconf import DictConfig, OmegaConf

from pipeline import isa
from pipeline.config import CONF, ROOT, check, compose_config, options

PARAMS = ROOT / "params.yaml"
REMAKE = "compose it again: python -m pipeline.tools.write_params [overrides]"


def kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return "a whole number"
    return {float: "a number", str: "text", list: "a list", dict: "a section"}.get(type(value), type(value).__name__)


def differ(given, wanted, at: str, groups: tuple = ()) -> str | None:
    """Where `given` (params.yaml) is not of the kind `wanted` (conf/'s composition) is, the first such key; a key
    missing counts under the config groups only (elsewhere an override may have deleted it: ~computed.<name>)."""
    if wanted is None or (isinstance(given, str) and given.startswith("${")):  # any value / an interpolation
        return None
    if isinstance(wanted, dict):
        if not isinstance(given, dict):
            return f"{at} is {kind(given)} ({given!r}), where conf/ gives a section"
        for key, value in wanted.items():
            path = f"{at}{'.' if at else ''}{key}"
            if key not in given:
                if path.split(".")[0] in groups:
                    return f"lacks {path}, which conf/ gives ({value!r})"
                continue
            found = differ(given[key], value, path, groups)
            if found:
                return found
        return None
    number = (int, float)
    same = (kind(given) == kind(wanted) or (isinstance(wanted, float) and isinstance(given, number)
                                             and not isinstance(given, bool)))
    return None if same else f"{at} is {kind(given)} ({given!r}), where conf/ gives {kind(wanted)} ({wanted!r})"


def check_kinds(cfg: DictConfig) -> None:
    """params.yaml against conf/ composed with the same group choices (each group's `name`): a key conf/ gives that
    params.yaml lacks, or holds text where a number belongs, a number where a list does..., fails naming the key."""
    groups = [p.name for p in CONF.iterdir() if p.is_dir()]
    choices = [f"{g}={cfg[g].name}" for g in groups if isinstance(cfg.get(g), DictConfig)
               and cfg[g].get("name") in options(g)]
    wanted = OmegaConf.to_container(compose_config(choices), resolve=False)
    found = differ(OmegaConf.to_container(cfg, resolve=False), wanted, "", tuple(groups))
    if found:
        raise ValueError(f"params.yaml {found}: correct it, or {REMAKE}")


def load(argv: list[str] | None = None) -> DictConfig:
    argv = sys.argv[1:] if argv is None else argv
    if not argv and PARAMS.exists():
        cfg = OmegaConf.load(PARAMS)
        check_kinds(cfg)
        check(cfg)
    else:
        cfg = compose_config(argv)
    isa.apply(cfg.isa)
    return cfg
