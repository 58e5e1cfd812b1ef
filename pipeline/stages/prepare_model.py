"""Stage prepare_model: a GGUF-sourced model dequantized once into its fp32 safetensors folder (model.path), and
data/models/prepared.json."""
from engine.model.loader import prepare
from pipeline.config import ROOT, model_spec
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        path = prepare(model_spec(cfg.model))
        print(f"model {cfg.model.name}: "
              + (f"prepared in {path}" if path else f"source {cfg.model.source}, nothing to do"))
        write_json(ROOT / "data" / "models" / "prepared.json", {"model": cfg.model.name, "source": cfg.model.source,
                                                                 "path": str(path) if path else None})
