"""Which product each weight shape uses at each row count: the fastest candidate measured on this machine, cached
per machine (CPU model and instruction sets, GPU, threads, torch, dtype, shape) so it is paid once.

Candidates: `in_out` (x @ W, W stored [in, out]), `linear` (F.linear, W stored [out, in]) and, on fp32 CPUs, `packed`
and `onednn` (MKL's and oneDNN's products on a weight laid out once in their own layouts: aten.py) and, where the
native kernels run, `fp32_tiles` (the weight packed in tiles of 16 rows, summed by FMA: engine/kernels/csrc/fp32.cpp).
A step of r rows uses the choice of the smallest bucket >= r (the last beyond it). Each candidate is timed over every
matrix of the shape (all layers), as a step streams them from memory (past STREAMED rows, where a product is
compute-bound, over a share of them, the time scaled), the fastest of REPEATS run back to back after one untimed run (a
run can only be slowed; and the candidate before can slow the next one's first run several times: GGUF's whole-matrix
GEMM frees hundreds of MB); measured again, a choice changes only for a candidate faster by more than MARGIN. Shapes
whose matrices together fit in a CPU's caches are not measured (their timings are noise) and keep `default`, as do
devices without a clock (`meta`). The matrices measured are any objects with `shape`, `dtype`, `weight_bytes`,
`hold(candidates)`, `product(candidate, x)` and `ops` (the native kernels or None: engine/model/layers/linear.py's
Dense); a storage with kernels of its own names its `family` and `candidates` (GgufDense: the per-row block kernel,
the dequantized tiles' and the GEMM's) and is measured whatever its size, grouped with its own family only
(engine/model/weights.py's choose_kernels). The cache: $LAB_CACHE_DIR/kernels.json (default
~/.cache/llm-batching-lab); delete it to measure again."""
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from engine import hardware
from engine.kernels import ISA_LIMITS

log = logging.getLogger(__name__)

BUCKETS = (1, 4, 16, 64, 256, 1024)  # rows a candidate is measured at (256: chunked prefills, 1024: whole prompts)
STREAMED = 64  # rows up to which a product streams its weights; beyond, compute-bound (see measure)
REPEATS = 3  # timed runs per candidate (after one untimed): the fastest kept
MARGIN = 0.05  # measured again, a cached choice stays unless another candidate is faster by more than this
SMALL_BYTES = 16 * 2**20  # a shape's matrices, all layers together, below this keep `default`
PRODUCTS = ("in_out", "linear", "packed", "onednn", "fp32_tiles")  # every candidate, where it runs (candidates)
OPAQUE = ("packed", "onednn", "fp32_tiles")  # candidates whose layout the weight's values cannot be read back from


def cache_path() -> Path:
    return hardware.cache_dir() / "kernels.json"


def has_packed(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


def has_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def candidates(device: torch.device, dtype: torch.dtype, native: bool = False) -> tuple[str, ...]:
    """The candidates that run here (native: the storage holds the native kernels)."""
    runs = {"packed": has_packed(device, dtype), "onednn": has_onednn(device, dtype),
            "fp32_tiles": native and device.type == "cpu" and dtype == torch.float32}
    return tuple(k for k in PRODUCTS if runs.get(k, True))


def candidates_of(mat, device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    """A storage's candidates: its own family's, else those that run here (the native ones where it holds them)."""
    if getattr(mat, "family", None):
        return mat.candidates
    return candidates(device, dtype, getattr(mat, "ops", None) is not None)


def default(device: torch.device, dtype: torch.dtype) -> list[str]:
    """Per bucket, the choice for unmeasured shapes: `in_out` at one row; beyond, `packed` where MKL runs, else
    `in_out`."""
    return ["in_out"] + ["packed" if has_packed(device, dtype) else "in_out"] * (len(BUCKETS) - 1)


def bucket(rows: int) -> int:
    """Index into BUCKETS of the choice a product of `rows` rows uses (called for every product of every step);
    plain comparisons, which torch.compile traces into guards on the row count (`bisect` would break its graph)."""
    for i, top in enumerate(BUCKETS[:-1]):
        if rows <= top:
            return i
    return len(BUCKETS) - 1




def machine_key(device: torch.device, dtype: torch.dtype) -> str:
    """The CPU and what its kernels may use (its flags, torch's CPU capability and any ISA limit set in the
    environment: the same CPU limited to AVX2 chooses anew), GPU, threads, torch and dtype."""
    cpu, flags = hardware.cpu_info()
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    isa = [torch.backends.cpu.get_cpu_capability(), *(os.environ.get(v) for v in ISA_LIMITS)]
    fields = [cpu, sorted(k for k, v in flags.items() if v), isa, gpu, torch.get_num_threads(), torch.__version__,
              str(dtype)]
    return hashlib.sha1(json.dumps(fields).encode()).hexdigest()[:12]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(mats: list, device: torch.device, names: tuple[str, ...]) -> dict:
    """{"ms": {rows: {candidate: fastest ms over all of `mats`}}, "choice": [fastest candidate per bucket]} for the
    Dense objects `mats` (one shape; each holds every candidate's layout while measured). Past STREAMED rows a
    product is compute-bound: a share of the matrices is timed and the time scaled to all of them."""
    din, dtype = mats[0].shape[0], mats[0].dtype
    ms, choice = {}, []
    for rows in BUCKETS:
        x = torch.randn(rows, din, dtype=dtype, device=device)
        some = mats[:max(1, len(mats) * STREAMED // rows)]
        runs = {k: (lambda k=k: [m.product(k, x) for m in some]) for k in names}
        times = {k: [] for k in runs}
        for k, run in runs.items():
            run()  # warm-up, which also absorbs what the candidate before left behind
            for _ in range(REPEATS):
                _sync(device)
                t = time.perf_counter()
                run()
                _sync(device)
                times[k].append((time.perf_counter() - t) * 1e3)
        ms[str(rows)] = {k: min(v) * len(mats) / len(some) for k, v in times.items()}
        choice.append(min(ms[str(rows)], key=ms[str(rows)].get))
    return {"ms": ms, "choice": choice}


def steady(before: list[str], fresh: dict) -> list[str]:
    """Per bucket, the earlier choice unless the fresh measurement's fastest beats it by more than MARGIN: near-ties
    (within this machine's noise) do not flip the engine's kernels from one measurement to the next."""
    out = []
    for old, new, rows in zip(before, fresh["choice"], BUCKETS):
        ms = fresh["ms"][str(rows)]
        out.append(old if ms[old] <= ms[new] * (1 + MARGIN) else new)
    return out


def read_cache(path: Path) -> dict:
    """The cached choices in `path`: {} where there is none yet, or where it is damaged (said in the log; the shapes are
    measured again and the file written whole)."""
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("kernel choices %s unreadable (%s: %s): measuring again", path, type(exc).__name__, exc)
        return {}
    if not isinstance(cached, dict) or not all(isinstance(v, dict) for v in cached.values()):
        log.warning("kernel choices %s are not a mapping of entries: measuring again", path)
        return {}
    return cached


def usable(entry, runs) -> bool:
    """A cached entry times every candidate of `runs` at every bucket ("ms": rows -> {candidate: ms}) and chooses
    one of them per bucket (an entry of other candidates or buckets, or a damaged one, is measured again)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("ms"), dict):
        return False
    ms, chosen = entry["ms"], entry.get("choice")
    return (all(isinstance(ms.get(str(rows)), dict) and set(ms[str(rows)]) == set(runs) for rows in BUCKETS)
            and isinstance(chosen, list) and len(chosen) == len(BUCKETS) and set(chosen) <= set(runs))


def choose(groups: dict[tuple, list], device: torch.device, dtype: torch.dtype, remeasure: bool = False) -> dict:
    """For each shape (in, out) -> its Dense objects: {"choice": [candidate per bucket], "ms": measured timings or
    None (not measured: `default`)}; measured once per machine and shape, then read from the cache (`remeasure`:
    measure again and replace the cached entry)."""
    path, key = cache_path(), machine_key(device, dtype)
    cached = read_cache(path)
    out, changed = {}, False
    for shape, mats in groups.items():
        family = getattr(mats[0], "family", None)  # a storage with kernels of its own (GGUF blocks): always measured
        runs = candidates_of(mats[0], device, dtype)
        native = "fp32_tiles" in runs  # a Dense that holds the native kernels: its own entry
        entry = f"{key}/{family + '/' if family else 'native/' if native else ''}{shape[0]}x{shape[1]}"
        small = family is None and sum(m.weight_bytes for m in mats) < SMALL_BYTES
        if device.type not in ("cpu", "cuda") or small and not remeasure:
            out[shape] = {"choice": default(device, dtype), "ms": None}
            continue
        if len(runs) == 1:  # one kernel (8-bit products): nothing to choose
            out[shape] = {"choice": [runs[0]] * len(BUCKETS), "ms": None}
            continue
        valid = usable(cached.get(entry), runs)
        if remeasure or not valid:
            for m in mats:
                m.hold(runs)
            fresh = measure(mats, device, runs)
            if valid:
                fresh["choice"] = steady(cached[entry]["choice"], fresh)
            cached[entry], changed = fresh, True
        out[shape] = cached[entry]
    if changed:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # written whole, then renamed: never a half-written cache
        tmp.write_text(json.dumps(cached, indent=1))
        os.replace(tmp, path)
    return out
