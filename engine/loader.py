"""Build or load the causal LM a config names; only plain configs in, a model and maybe a tokenizer out."""
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_model(config: dict, seed: int, dtype: torch.dtype = torch.float32):
    """A random-weight model built in memory from a plain config dict (no download)."""
    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    with torch.device("meta" if hf_config.hidden_size >= 2048 else "cpu"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if next(model.parameters()).is_meta:  # a large shape: allocate, then fill with small random values
        model = model.to_empty(device="cpu")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).mul_(0.02).to(dtype))
            for name, buf in model.named_buffers():  # rotary inv_freq was lost with the meta device
                if name.endswith("inv_freq"):
                    rotary = model.get_submodule(name.rsplit(".", 1)[0])
                    inv, _ = rotary.rope_init_fn(rotary.config, "cpu")
                    buf.copy_(inv)
    return model.eval()


def load_model(model_cfg, dtype: str = "float32", device: str = "cpu"):
    """Return (model, tokenizer or None) for a conf/model entry."""
    torch_dtype = DTYPES[dtype]
    if model_cfg.source == "random":
        config = {k: v for k, v in dict(model_cfg.config).items()}
        return random_model(config, int(model_cfg.seed), torch_dtype).to(device), load_tokenizer(model_cfg)
    path = Path(model_cfg.path)
    if model_cfg.source == "gguf" and not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not prepared: run `dvc repro prepare_model` (or python -m pipeline.prepare_model)")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    return model, load_tokenizer(model_cfg)


def load_tokenizer(model_cfg):
    """The tokenizer a conf/model entry names, or None (random-weight models without one)."""
    if model_cfg.source == "random":
        return AutoTokenizer.from_pretrained(model_cfg.tokenizer) if model_cfg.get("tokenizer") else None
    return AutoTokenizer.from_pretrained(str(model_cfg.path))


def eos_ids(model) -> list[int]:
    """Every end-of-sequence id of the model's generation config (Llama 3.1 has several)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]
