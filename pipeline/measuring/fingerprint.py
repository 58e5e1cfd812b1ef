"""This machine's fingerprint: what can change a measurement (the CPU and the instruction sets its kernels use, the
isa level the process is held to, cores, threads, memory, GPUs, library and model package versions, whether the
native CPU kernels built). Every measuring stage records it, and a new fingerprint reruns them."""
import hashlib
import json
import os
import platform

import torch
import transformers

from engine.hardware import MODEL_PACKAGES, cpu_info, memory_gib, package_version
from engine.kernels import build
from pipeline import isa


def environment(threads: int | None = None, device: str = "cpu") -> dict:
    """This machine's fingerprint; `threads`: torch CPU threads the measurement uses (default: torch's setting)."""
    cpu, flags = cpu_info()
    gpus = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if torch.cuda.is_available() else [])
    fields = {"cpu": cpu, "cpu_flags": flags, "isa": isa.held(flags), "cores": os.cpu_count(),
              "threads": int(threads or torch.get_num_threads()),
              "memory_gib": memory_gib(), "gpus": gpus, "device": device,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "model_packages": {p: package_version(p) for p in MODEL_PACKAGES},
              "fused_kernels": build.ops() is not None}
    fid = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return {"id": fid, "label": label(fields), **fields}


def label(fp: dict) -> str:
    """One line naming a machine: CPU and its widest vector unit (or the one an isa level holds it to, and on what),
    threads, GPUs, torch."""
    f = fp["cpu_flags"]
    unit = isa.unit(fp["isa"], f) or ("AMX" if f.get("amx_tile") else isa.vector_unit(f))
    gpu = f", {len(fp['gpus'])} x {fp['gpus'][0]}" if fp["gpus"] else ""
    return f"{fp['cpu']} ({unit}), {fp['threads']} threads{gpu}, torch {fp['torch']}"
