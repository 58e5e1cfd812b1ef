"""The roofline of a composed config: its model's shape at its precision on its hardware, a spec sheet from
conf/hardware/ (computed, efficiency terms as calibrated there), or this CPU from its probe (reports/hardware.json:
the bandwidth and matrix rate measured here) for the one comparison against measured steps."""
import json

from omegaconf import OmegaConf

from pipeline.config import ROOT
from pipeline.modeling.roofline import DTYPE_BYTES, GB, Efficiency, Roofline, Shape

MEMORY_UTILIZATION = 0.9   # share of a device's memory an engine takes for weights and K/V (vLLM's default)


def model_shape(model) -> Shape:
    """A conf/model entry's shape: its `config`, else the prepared folder's config.json."""
    if "config" in model:
        return Shape.of(OmegaConf.to_container(model.config, resolve=True))
    path = ROOT / model.path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run `dvc repro prepare_model` for model {model.name}")
    return Shape.of(json.loads(path.read_text()))


def spec_roofline(cfg, tp: int | None = None) -> Roofline:
    """The computed roofline of cfg.model at cfg.precision on cfg.hardware (a GPU's spec sheet), over `tp` devices
    (default: the hardware's `tp`)."""
    hw, prec = cfg.hardware, cfg.precision
    if hw.kind == "cpu":
        raise ValueError("hardware=cpu is this machine, measured: choose a spec sheet of conf/hardware "
                         "(e.g. hardware=h100-sxm) to compute a step")
    rates = dict(hw.tflops)
    if prec.compute not in rates or prec.dtype not in DTYPE_BYTES:
        raise ValueError(f"hardware {hw.name} lists matrix rates for {sorted(rates)}; precision {prec.name} computes "
                         f"in {prec.compute}: choose a precision that computes in one of them (e.g. bf16-cuda)")
    tp = int(tp or hw.get("tp", 1))
    return Roofline(model_shape(cfg.model), hw.bandwidth_gbs * GB, rates[prec.compute] * 1e12,
                    DTYPE_BYTES[prec.dtype], DTYPE_BYTES[prec.kv_dtype],
                    Efficiency(**{k: float(v) for k, v in hw.efficiency.items() if k in Efficiency.__annotations__}),
                    tp, hw.interconnect_gbs * GB, DTYPE_BYTES[prec.dtype])


def kv_budget_bytes(roof: Roofline, memory_gb: float) -> float:
    """Bytes left for K/V on each device once the weights are in (MEMORY_UTILIZATION of its memory)."""
    return memory_gb * GB * MEMORY_UTILIZATION - roof.weights_bytes()


def cpu_roofline(hw: dict, shape: Shape, kv_bytes: float) -> Roofline:
    """This CPU's roofline from its probe (reports/hardware.json): the measured bandwidth and matrix rate of the
    level's compute type, the bytes a step reads as the level stores them, every efficiency term at 1 and no fixed
    cost: the method, uncalibrated."""
    per_step = shape.layers * shape.layer_params + shape.head_params  # weights a step reads
    rate = hw["gflops"]["bf16" if hw["compute"] == "bf16" else "fp32"]
    return Roofline(shape, hw["bandwidth_gbs"] * GB, rate * 1e9, hw["weight_bytes"] / per_step, kv_bytes)


def fewest_devices(cfg, most: int = 64) -> int:
    """The fewest devices (a power of two) over which cfg.model's weights leave room for K/V on cfg.hardware."""
    tp = 1
    while kv_tokens(spec_roofline(cfg, tp), float(cfg.hardware.memory_gb)) <= 0:
        if tp >= most:
            raise ValueError(f"model {cfg.model.name} does not fit {most} x {cfg.hardware.name}")
        tp *= 2
    return tp


def kv_tokens(roof: Roofline, memory_gb: float) -> float:
    """K/V tokens the devices hold once the weights are in (0 where the weights alone do not fit)."""
    return max(0.0, kv_budget_bytes(roof, memory_gb)) / roof.kv_bytes_per_token()
