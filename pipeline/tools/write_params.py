"""python -m pipeline.tools.write_params [overrides]: write params.yaml from conf/, as DVC's Hydra integration does."""
import sys

from omegaconf import OmegaConf

from pipeline.config import compose_config
from pipeline.params import PARAMS

if __name__ == "__main__":
    OmegaConf.save(compose_config(sys.argv[1:]), PARAMS)
    print(f"wrote {PARAMS}")
