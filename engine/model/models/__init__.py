"""The architectures the engine runs, one file each in this folder: every class there with `model_types` runs those
Hugging Face model types (a new architecture is a new file, found here by its module)."""
import importlib
import pkgutil

from engine.model.forward import FlatModel
from engine.model.support import check_supported

ARCHITECTURES = {t: cls for info in pkgutil.iter_modules(__path__)
                 for cls in vars(importlib.import_module(f"{__name__}.{info.name}")).values()
                 if isinstance(cls, type) and issubclass(cls, FlatModel) and cls.__module__ == f"{__name__}.{info.name}"
                 for t in cls.model_types}
SUPPORTED = tuple(sorted(ARCHITECTURES))


def architecture(hf_model):
    """The class that runs this Hugging Face model; a ValueError naming the field where it would not reproduce it."""
    cfg = hf_model.config
    if cfg.model_type not in ARCHITECTURES:
        raise ValueError(f"model_type = {cfg.model_type!r} is not supported by the engine; it runs {SUPPORTED}")
    arch = ARCHITECTURES[cfg.model_type]
    check_supported(arch, hf_model)
    return arch
