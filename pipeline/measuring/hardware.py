"""What this machine can do for a model, measured: read bandwidth, fp32 and bf16 matrix rates, the floor of a
decode step per batch (the model's own matrix products), the roofline, KV bytes per token and the seats that fit a
memory budget, and where the engine's decode step spends its time (torch.profiler, by part: the top-level operators)."""
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import SamplingParams
from engine.core.kv_pools import seat_bytes
from engine.factory import build_engine
from engine.kernels import build
from engine.kernels.choice import BUCKETS
from engine.model.forward import HEAD_SPAN, FlatModel
from engine.model.layers.linear import Bf16Dense
from engine.model.runner import SAMPLER_SPAN
from engine.model.weights import PRODUCTS
from engine.specs import PolicySpec
from pipeline.config import build_net, group_entry, kv_spec, options
from pipeline.measuring.disturbance import measured
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.levels import level_nets
from pipeline.measuring.timing import bandwidth_gbs, best_of, step_floor_ms
from pipeline.workloads.prompts import prompts_for

BATCHES = [1, 4, 16, 64, 128]
CONTEXTS = [1024, 2048, 4096, 8192]
SPLIT_BATCHES = [1, 64]  # decode steps whose time is split by part
PARTS = {"LM head": (HEAD_SPAN,),
         "sampler": (SAMPLER_SPAN,),
         "matrix products": ("aten::mm", "aten::addmm", "aten::matmul", "aten::linear", "mkl::_mkl_linear",
                             "flat::packed_linear", "mkldnn::_linear_pointwise", "flat::onednn_linear"),
         "decode attention": ("aten::bmm", "aten::softmax", "aten::_softmax", "lab::decode_attention",
                              "lab::token_attention"),
         "RMS norms": ("aten::rms_norm", "lab::rms_norm"),
         "KV writes": ("aten::index_copy_", "lab::write_rows_")}  # top-level operator -> part; else "other operators"
NAMESPACES = {name.split("::")[0] for names in PARTS.values() for name in names}  # operators, not spans
LAYER = "lab::layers"  # every decoder layer in one call: its operators (norms, KV writes, attention...) named inside


def part_of(name: str) -> str:
    """The part a top-level operator or span counts in: PARTS's, any of the native library's products (lab::*linear,
    every weight format) a matrix product, else "other operators"."""
    if name.startswith("lab::") and name.endswith("linear"):
        return "matrix products"
    return next((k for k, names in PARTS.items() if name in names), "other operators")


def matmul_gflops(dtype: torch.dtype, device: str, n: int = 1536) -> float:
    """An n x n by n x n product's rate, GFLOP/s: torch's; bf16 on a CPU the bf16 level's own (the lab's native
    products, the fastest of them: a CPU's bf16 level never runs torch's bf16 product, which without AVX512-BF16
    runs a hundred times slower), torch's only where the native kernels are not built."""
    a, b = torch.randn(n, n, device=device).to(dtype), torch.randn(n, n, device=device).to(dtype)
    ops = build.ops() if dtype == torch.bfloat16 and device == "cpu" else None
    if ops is None:
        return 2 * n ** 3 / best_of(lambda: a @ b, device) / 1e9
    w, x = Bf16Dense(b.T.contiguous(), ops=ops), a.float()
    return 2 * n ** 3 / min(best_of(lambda c=c: w.product(c, x), device, 3) for c in w.candidates) / 1e9


def step_split(net: FlatModel, batch: int, steps: int = 6, fused: bool = True) -> dict:
    """One engine decoding `batch` short chat prompts: its decode step's wall time (median of `steps`, ms), then
    the same steps under torch.profiler, split into PARTS by top-level operator, "other operators", and the time
    outside operators (Python, scheduling, sampling bookkeeping), ms per step; the profiler's own cost makes the
    profiled step longer than the plain one. fused: the net's native CPU kernels (engine/kernels/build.py) if it
    has them, else ATen's operators alone."""
    ops = net.ops
    net.use_ops(ops if fused else None)
    try:
        return {**_split(net, batch, steps), "kernels": "fused" if net.ops is not None else "ATen"}
    finally:
        net.use_ops(ops)


def _split(net: FlatModel, batch: int, steps: int) -> dict:
    prompts = prompts_for("chat", batch, None, net.vocab_size)
    eng = build_engine(net, PolicySpec("continuous", batch), max(map(len, prompts)) + 3 * steps + 4)
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, SamplingParams(max_new_tokens=3 * steps + 3, ignore_eos=True))
    for _ in range(steps + 2):  # the prefill and one decode step warm up; the last `steps` are timed
        eng.step()
    wall = [r.duration for r in eng.take_records()[-steps:]]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            eng.step()
        profiled = (time.perf_counter() - t) / steps * 1e3
    parts = dict.fromkeys([*PARTS, "other operators", "rest of the layers call"], 0.0)
    for e in prof.events():
        parent = e.cpu_parent.name if e.cpu_parent is not None else None
        if e.name == LAYER:  # one call a step: its own work, its products counted below
            parts["rest of the layers call"] += e.self_cpu_time_total / 1e3 / steps
        elif (parent is None or parent == LAYER) and e.name.split("::")[0] in NAMESPACES:
            part = part_of(e.name)
            parts[part] += e.cpu_time_total / 1e3 / steps
    parts["outside operators"] = max(0.0, profiled - sum(parts.values()))
    return {"batch": batch, "step_ms": statistics.median(wall) * 1e3, "profiled_ms": profiled, "parts": parts}


def kernel_table(cfg, model) -> dict:
    """Which kernel each precision level of this device runs for each product at each row bucket (a step of r rows
    takes the smallest bucket >= r), from the engine built at that level on this machine: {"buckets", "build" (what
    the native library runs, engine/kernels/build.py), "levels": {level: {product: [kernels per bucket]}},
    "skipped": {level: why}}. A product whose layers differ lists each kernel with its count of layers."""
    names = [p for p in options("precision") if group_entry("precision", p)["device"] == cfg.precision.device]
    levels, skipped, _ = level_nets(cfg, names, {(cfg.precision.dtype, cfg.precision.device): (model, None)})
    table = {}
    for name, (net, _, _) in levels.items():
        groups = {"head": [net.lm_head], **{p: [getattr(layer, p) for layer in net.layers] for p in PRODUCTS}}
        table[name] = {k: [_kernels(ds, b) for b in range(len(BUCKETS))] for k, ds in groups.items()}
    return {"buckets": list(BUCKETS), "build": build.capabilities(), "levels": table, "skipped": skipped}


def _kernels(products: list, bucket: int) -> str:
    counts = {}
    for d in products:
        counts[d.kernel(bucket)] = counts.get(d.kernel(bucket), 0) + 1
    return next(iter(counts)) if len(counts) == 1 else ", ".join(f"{k} x{n}" for k, n in counts.items())


def probe(cfg, model) -> dict:
    """The probe's figures for a Hugging Face model; each timed part measured again while disturbed (cfg.measure),
    what the machine did meanwhile in `disturbance`."""
    dev, limits = cfg.precision.device, cfg.measure
    params = sum(p.numel() for p in model.parameters())
    net, choice = measured(lambda: build_net(model, cfg, remeasure=True), limits,
                           "probe: kernel choice")
    weight_bytes = net.step_bytes
    (bw, flops), rates = measured(lambda: (bandwidth_gbs(dev), {"fp32": matmul_gflops(torch.float32, dev),
                                                                "bf16": matmul_gflops(torch.bfloat16, dev)}),
                                  limits, "probe: bandwidth and matrix rates")
    rate = flops["bf16" if cfg.precision.compute == "bf16" else "fp32"]
    ridge = rate / bw  # FLOP per byte where memory time equals math time
    floor_ms, floor_watch = measured(lambda: {b: step_floor_ms(net, b) for b in BATCHES}, limits, "probe: floors")
    floors = []
    for b in BATCHES:
        mem_ms, math_ms = weight_bytes / bw / 1e6, 2 * params * b / rate / 1e6
        floors.append({"batch": b, "measured_ms": floor_ms[b], "tok_s_ceiling": b / floor_ms[b] * 1e3,
                       "roofline_ms": max(mem_ms, math_ms), "intensity": 2 * params * b / weight_bytes,
                       "regime": "memory-bound" if mem_ms >= math_ms else "compute-bound"})
    both = (True, False) if net.ops is not None else (True,)  # fused kernels, then ATen's, where both run
    split, split_watch = measured(lambda: [step_split(net, b, fused=f) for b in SPLIT_BATCHES for f in both]
                                  if dev == "cpu" else [], limits, "probe: step split")  # GPU: asynchronous
    kv = net.kv_bytes_per_token
    total = torch.cuda.get_device_properties(0).total_memory if dev.startswith("cuda") else \
        int(open("/proc/meminfo").readline().split()[1]) * 1024
    budget = 0.8 * total - weight_bytes  # 80% of the device's memory, less the weights
    bs, layer_kv = int(kv_spec("paged").block_size), kv // net.num_layers
    seats = []
    for c in CONTEXTS:  # each layer its window's blocks (paged), against every layer keeping the whole context
        held = seat_bytes(net.windows, c, layer_kv, bs)
        seats.append({"context": c, "kv_mb_per_seat": held / 2**20, "seats_that_fit": int(budget // held),
                      "seats_every_layer_full": int(budget // seat_bytes([None] * net.num_layers, c, layer_kv, bs))})
    return {"model": cfg.model.name, "precision": cfg.precision.name, "compute": cfg.precision.compute,
            "dtype": cfg.precision.dtype, "params": params, "weight_bytes": weight_bytes,
            "bandwidth_gbs": bw, "gflops": flops, "ridge_flop_per_byte": ridge, "floors": floors,
            "step_split": split, "kv_bytes_per_token": kv, "memory_bytes": total, "kv_budget_bytes": budget,
            "seats": seats, "kernels": [{"shape": list(shape), **c} for shape, c in net.kernels.items()],
            "kernel_table": kernel_table(cfg, model),
            "disturbance": {"kernel choice": choice.fields(), "rates": rates.fields(),
                            "floors": floor_watch.fields(), "step split": split_watch.fields()},
            "machine": environment(cfg.threads, dev)}
