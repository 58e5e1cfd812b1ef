"""A stage's config: params.yaml (composed from conf/ by DVC) when run without arguments, as DVC runs stages;
else conf/ composed with the Hydra overrides given."""
import sys

from omegaconf import DictConfig, OmegaConf

from engine.config import ROOT, compose_config

PARAMS = ROOT / "params.yaml"


def load(argv: list[str] | None = None) -> DictConfig:
    argv = sys.argv[1:] if argv is None else argv
    if not argv and PARAMS.exists():
        return OmegaConf.load(PARAMS)
    return compose_config(argv)
