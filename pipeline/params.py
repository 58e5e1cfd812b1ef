"""A stage's config: params.yaml (composed from conf/ by DVC) when run without arguments, as DVC runs stages;
else conf/ composed with the Hydra overrides given. Either way a precision level the model cannot run fails here
(params.yaml may have been edited since it was composed: `dvc exp run -S` sets its keys one by one), and the process
then runs under its isa level (pipeline/isa.py: executed again with the level's environment where it differs)."""
import sys

from omegaconf import DictConfig, OmegaConf

from pipeline import isa
from pipeline.config import ROOT, check, compose_config

PARAMS = ROOT / "params.yaml"


def load(argv: list[str] | None = None) -> DictConfig:
    argv = sys.argv[1:] if argv is None else argv
    if not argv and PARAMS.exists():
        cfg = OmegaConf.load(PARAMS)
        check(cfg)
    else:
        cfg = compose_config(argv)
    isa.apply(cfg.isa)
    return cfg
