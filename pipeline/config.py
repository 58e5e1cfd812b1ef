"""Stage config: params.yaml (composed from conf/ by DVC), or conf/ composed with Hydra overrides from argv."""
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent
PARAMS = ROOT / "params.yaml"


def compose_config(overrides: list[str] = ()) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides; a bad option fails here and lists the valid ones."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


def load_configured_model(cfg, engine_only: bool = False):
    """(model, tokenizer or None) for a composed config, with torch's CPU threads set first (cfg.threads).
    engine_only: the engine takes the weights into its own layout (FlatModel.of(model, take=True)), so they exist
    once; the Hugging Face model then keeps its config but can no longer run `generate`."""
    import torch

    from engine.loader import load_model
    from engine.model import FlatModel

    torch.set_num_threads(int(cfg.threads))
    model, tokenizer = load_model(cfg.model, cfg.precision.dtype, cfg.precision.device)
    if engine_only:
        FlatModel.of(model, take=True)
    return model, tokenizer


def load(argv: list[str] | None = None) -> DictConfig:
    """params.yaml when run without arguments (as DVC does), else conf/ with the given overrides."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv and PARAMS.exists():
        return OmegaConf.load(PARAMS)
    return compose_config(argv)


if __name__ == "__main__":  # python -m pipeline.config [overrides]: write params.yaml as DVC's Hydra integration does
    OmegaConf.save(compose_config(sys.argv[1:]), PARAMS)
    print(f"wrote {PARAMS}")
