"""Stage probe_hardware: what this machine can do for the configured model, measured, and what stops a batch.

Writes reports/hardware.json and reports/HARDWARE.md: read bandwidth, fp32 and bf16 matrix rates, the ridge
point, the floor of a decode step per batch size (the model's own matrix products, measured, and the roofline),
KV bytes per token and the seats that fit a memory budget (seed 000's memory table), and where the engine's own
decode step spends its time (torch.profiler, by kind of operator).
"""
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import LLMEngine, SamplingParams, kernels
from engine.model import FlatModel
from pipeline.config import ROOT, load, load_configured_model
from pipeline.env import environment
from pipeline.io import write_json, write_text
from pipeline.prompts import prompts_for
from pipeline.speed import best_of, step_floor_ms

BATCHES = [1, 4, 16, 64, 128]
CONTEXTS = [1024, 4096]
SPLIT_BATCHES = [1, 64]  # decode steps whose time is split by kind of operator
PARTS = {"matrix products": ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "mkl::_mkl_linear",
                             "flat::packed_linear", "mkldnn::_linear_pointwise", "flat::onednn_linear"),
         "decode attention": ("aten::bmm", "aten::softmax", "aten::_softmax", "lab::decode_attention",
                              "lab::token_attention"),
         "RMS norms": ("aten::rms_norm", "lab::rms_norm"),
         "KV writes": ("aten::index_copy_", "lab::write_rows_")}  # top-level operator -> part; else "other operators"
NAMESPACES = {name.split("::")[0] for names in PARTS.values() for name in names}  # operators, not spans


def bandwidth_gbs(device: str) -> float:
    """Streaming read: sum of a 512 MiB fp32 tensor, GB/s."""
    x = torch.ones(128 * 2**20, device=device)
    return x.numel() * 4 / best_of(lambda: x.sum(), device) / 1e9


def matmul_gflops(dtype: torch.dtype, device: str, n: int = 1536) -> float:
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / best_of(lambda: a @ b, device) / 1e9


def step_split(net: FlatModel, batch: int, steps: int = 6, fused: bool = True) -> dict:
    """One engine decoding `batch` short chat prompts: its decode step's wall time (median of `steps`, ms), then
    the same steps under torch.profiler, split into PARTS by top-level operator, "other operators", and the time
    outside operators (Python, scheduling, sampling bookkeeping), ms per step. The profiler adds a few
    microseconds to each operator, so the profiled step is longer than the plain one. fused: the net's fused CPU
    kernels (engine/native.py) if it has them, else ATen's operators alone."""
    ops = net.fused
    net.fused = ops if fused else None
    try:
        return {**_split(net, batch, steps), "kernels": "fused" if net.fused is not None else "ATen"}
    finally:
        net.fused = ops


def _split(net: FlatModel, batch: int, steps: int) -> dict:
    prompts = prompts_for("chat", batch, None, net.vocab_size)
    eng = LLMEngine(net, {"name": "continuous", "max_seats": batch}, max(map(len, prompts)) + 3 * steps + 4)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=3 * steps + 3, ignore_eos=True))
    for _ in range(steps + 2):  # the prefill and one decode step warm up; the last `steps` are timed
        eng.step()
    wall = [s["duration"] for s in eng.steps[-steps:]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        profiled = (time.perf_counter() - t) / steps * 1e3
    parts = dict.fromkeys([*PARTS, "other operators"], 0.0)
    for e in prof.events():
        if e.cpu_parent is None and e.name.split("::")[0] in NAMESPACES:
            part = next((k for k, names in PARTS.items() if e.name in names), "other operators")
            parts[part] += e.cpu_time_total / 1e3 / steps
    parts["outside operators"] = max(0.0, profiled - sum(parts.values()))
    return {"batch": batch, "step_ms": statistics.median(wall) * 1e3, "profiled_ms": profiled, "parts": parts}


def main(cfg) -> dict:
    dev = cfg.precision.device
    model, _ = load_configured_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    net = FlatModel(model, take=True, remeasure=True)  # this machine's kernel choice, measured again and cached
    weight_bytes = params * net.embed.element_size()
    bw = bandwidth_gbs(dev)
    flops = {"fp32": matmul_gflops(torch.float32, dev), "bf16": matmul_gflops(torch.bfloat16, dev)}
    rate = flops["fp32" if net.dtype == torch.float32 else "bf16"]
    ridge = rate / bw  # FLOP per byte where memory time equals math time
    floors = []
    for b in BATCHES:
        mem_ms, math_ms = weight_bytes / bw / 1e6, 2 * params * b / rate / 1e6
        measured = step_floor_ms(net, b)
        floors.append({"batch": b, "measured_ms": measured, "tok_s_ceiling": b / measured * 1e3,
                       "roofline_ms": max(mem_ms, math_ms), "intensity": 2 * params * b / weight_bytes,
                       "regime": "memory-bound" if mem_ms >= math_ms else "compute-bound"})
    both = (True, False) if net.fused is not None else (True,)  # fused kernels, then ATen's, where both run
    split = [step_split(net, b, fused=f) for b in SPLIT_BATCHES for f in both] if dev == "cpu" else []  # GPU: async
    kv = net.kv_bytes_per_token
    total = torch.cuda.get_device_properties(0).total_memory if dev.startswith("cuda") else \
        int(open("/proc/meminfo").readline().split()[1]) * 1024
    budget = 0.8 * total - weight_bytes  # 80% of the device's memory, less the weights
    seats = [{"context": c, "kv_mb_per_seat": c * kv / 2**20, "seats_that_fit": int(budget // (c * kv))}
             for c in CONTEXTS]
    out = {"model": cfg.model.name, "dtype": cfg.precision.dtype, "params": params, "weight_bytes": weight_bytes,
           "bandwidth_gbs": bw, "gflops": flops, "ridge_flop_per_byte": ridge, "floors": floors,
           "step_split": split,
           "kv_bytes_per_token": kv, "memory_bytes": total, "kv_budget_bytes": budget, "seats": seats,
           "kernels": [{"shape": list(shape), **c} for shape, c in net.kernels.items()],
           "machine": environment(cfg.threads, dev)}
    write_json(ROOT / "reports" / "hardware.json", out)
    write_text(ROOT / "reports" / "HARDWARE.md", render(out))
    return out


def render_split(h: dict) -> list[str]:
    if not h["step_split"]:
        return []
    names = list(h["step_split"][0]["parts"])
    lines = ["## Where the engine's decode step goes", "",
             "The engine decoding B short chat prompts: its step's wall time (median of 6), then the same steps under "
             "torch.profiler split by kind of top-level operator, ms per step (the profiler adds a few microseconds "
             "per operator, so the profiled step is longer). `outside operators`: Python, scheduling, sampling "
             "bookkeeping, and most of the profiler's own cost. The floor is the matrix products alone (above). "
             "`fused`: the engine's own kernels for norms, rotary, SiLU x up, KV writes and decode attention "
             "(engine/native.py, the default where they build); `ATen`: torch's operators for them.", "",
             "| B | kernels | step, ms | floor, ms | profiled step, ms | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]
    floor = {f["batch"]: f["measured_ms"] for f in h["floors"]}
    for sp in h["step_split"]:
        lines.append(f"| {sp['batch']} | {sp['kernels']} | {sp['step_ms']:.1f} | "
                     f"{floor.get(sp['batch'], float('nan')):.1f} | "
                     f"{sp['profiled_ms']:.1f} | " + " | ".join(f"{v:.1f}" for v in sp["parts"].values()) + " |")
    return lines + [""]


def render(h: dict) -> str:
    lines = [f"# Hardware: {h['machine']['label']}", "",
             f"Generated by `python -m pipeline.probe_hardware` for {h['model']} ({h['params'] / 1e6:.1f}M parameters, "
             f"{h['dtype']}, {h['weight_bytes'] / 1e6:.0f} MB of weights), {h['machine']['threads']} threads, on machine "
             f"`{h['machine']['id']}` (reports/machine.json). "
             "All figures measured unless marked computed.", "",
             "| what | value |", "|---|---|",
             f"| streaming read bandwidth | {h['bandwidth_gbs']:.1f} GB/s |",
             f"| fp32 matrix rate | {h['gflops']['fp32']:.0f} GFLOP/s |",
             f"| bf16 matrix rate | {h['gflops']['bf16']:.0f} GFLOP/s |",
             f"| ridge point (computed) | {h['ridge_flop_per_byte']:.1f} FLOP/byte |",
             f"| KV bytes per token (computed) | {h['kv_bytes_per_token'] / 1024:.1f} KiB |", "",
             "## The floor of a decode step: the model's matrix products on B rows", "",
             "| B | measured, ms | x the B=1 step | tok/s ceiling | roofline, ms (computed) | FLOP/byte (computed) | "
             "regime by roofline (computed) |", "|---|---|---|---|---|---|---|"]
    one = h["floors"][0]["measured_ms"]
    for f in h["floors"]:
        lines.append(f"| {f['batch']} | {f['measured_ms']:.1f} | {f['measured_ms'] / one:.2f} | "
                     f"{f['tok_s_ceiling']:.0f} | {f['roofline_ms']:.1f} | {f['intensity']:.1f} | {f['regime']} |")
    lines += ["", "The floor uses, for each matrix shape and row count, the product measured fastest on this machine "
              "(engine/kernels.py; the engine uses the same choice). Each candidate's time for every matrix of the "
              f"shape (all layers; past {kernels.STREAMED} rows a share of them, scaled), median of {kernels.REPEATS}, "
              "ms; the chosen one in bold (measured again on every run, a choice "
              f"changes only for a candidate faster by more than {kernels.MARGIN:.0%}):", "",
              "| shape (in x out) | rows | " + " | ".join(kernels.KINDS) + " |", "|---|---|" + "---|" * len(kernels.KINDS)]
    for k in h["kernels"]:
        for i, (rows, ms) in enumerate((k["ms"] or {}).items()):
            cells = [("**%.1f**" if name == k["choice"][i] else "%.1f") % ms[name] if name in ms else "n/a"
                     for name in kernels.KINDS]
            lines.append(f"| {k['shape'][0]} x {k['shape'][1]} | {rows} | " + " | ".join(cells) + " |")
    lines += ["", "A step is memory-bound while its FLOP per weight byte is below the ridge point, compute-bound "
              "above it. On a CPU the ridge is low, and small matrix products run well below the peak rate, so the "
              "measured step grows long before the roofline says it should (the `x the B=1 step` column): "
              "batching stops being free after a few rows. On a GPU decode stays memory-bound to large batches.", "",
              *render_split(h)]
    lines += ["## Seats that fit: KV memory per seat against a budget (computed)", "",
              f"Budget: 80% of {h['memory_bytes'] / 2**30:.0f} GiB less the weights = "
              f"{h['kv_budget_bytes'] / 2**30:.1f} GiB.", "",
              "| context per seat, tokens | KV per seat, MiB | seats that fit |", "|---|---|---|"]
    for s in h["seats"]:
        lines.append(f"| {s['context']} | {s['kv_mb_per_seat']:.1f} | {s['seats_that_fit']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(load())
