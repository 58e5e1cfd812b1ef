"""The native CPU kernels (torch.ops.lab, sources in engine/kernels/csrc/, every operator registered in ops.cpp),
built into one library once per machine with the system's C++ compiler for the best instruction-set build this CPU
and torch run (BUILDS: AVX-512 with or without VNNI, AVX2, scalar; $LAB_KERNELS_BUILD names another) and kept in
$LAB_CACHE_DIR/native/ under a hash of the sources, torch's version and the flags, with its sha256 beside it (a library
that does not match it, truncated or damaged, is built again, said in the log). Where building or loading fails,
`ops()` is None and the steps run ATen's operators instead; the reason is logged once and kept in `error`.
`capabilities()` says what the loaded build runs. The compiler: $CXX, else g++.
"""
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from engine import hardware
from engine.children import dies_with_parent, gone, running
from engine.hardware import sha256
from engine.kernels import BUILD_VAR

log = logging.getLogger(__name__)
HERE = Path(__file__).parent / "csrc"
BUILDING = "building-"  # a build folder's name: this, its process id, a random tail
SOURCES = [HERE / f for f in ("ops.cpp", "native.cpp", "decode_attention.cpp", "token_attention.cpp", "q4_1.cpp",
                              "q8_0.cpp", "q4_k.cpp", "q5_0.cpp", "q6_k.cpp", "bf16.cpp", "fp32.cpp",
                              "layer.cpp")]  # in parallel
AVX512 = ["-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma"]
BUILDS = {"AVX512-VNNI": [*AVX512, "-DLAB_VNNI"],  # Q4_1's integer products (gguf_kernels.h) where the CPU has VNNI
          "AVX512": AVX512, "AVX2": ["-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
          "scalar": []}  # instruction-set build -> its compiler flags, best first (F16C: with every AVX2 CPU)
PRODUCTS = ("in_out", "linear", "packed", "onednn", "q4_1", "q8_0", "bf16", "q4_1_tiles", "q8_0_tiles",
            "bf16_tiles", "q4_1_mm", "q8_0_mm", "bf16_mm", "q4_k", "q5_0", "q6_k", "q4_k_tiles", "q5_0_tiles",
            "q6_k_tiles", "q4_k_mm", "q5_0_mm", "q6_k_mm", "segments",
            "fp32_tiles", "q4_1_a8", "q8_0_a8", "q4_k_a8", "q5_0_a8", "q6_k_a8")  # lab.layers' kinds (products.h)
TORCH_HEADERS = ("ATen/Parallel.h", "ATen/core/Tensor.h", "ATen/ops/empty.h", "ATen/ops/addmm.h", "ATen/ops/mm.h",
                 "torch/library.h")  # torch's headers the sources include: parsed once per build (a precompiled header)
GGUF_FORMATS = ("q4_1", "q8_0", "q4_k", "q5_0", "q6_k")  # the block formats of gguf_blocks.h (ops.h's LAB_GGUF)
error: str | None = None  # why the kernels are not there, once tried
_loaded = False


def builds() -> list[str]:
    """The builds of BUILDS this CPU runs under torch's CPU capability, best first."""
    capability = torch.backends.cpu.get_cpu_capability()
    best = {"AVX512": 0 if hardware.cpu_info()[1]["avx512_vnni"] else 1, "AVX2": 2}.get(capability, 3)
    return list(BUILDS)[best:]


def _flags(build: str | None = None) -> list[str]:
    """The compiler flags of `build` (default: $LAB_KERNELS_BUILD, else the best this CPU runs)."""
    from torch.utils import cpp_extension  # include and library folders of this torch

    build = build or os.environ.get(BUILD_VAR) or builds()[0]
    if build not in builds():
        raise ValueError(f"{BUILD_VAR}={build}: this CPU runs the builds {builds()}")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    libs = cpp_extension.library_paths()
    return (["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", abi, *BUILDS[build]]
            + [f"-I{p}" for p in cpp_extension.include_paths()]
            + [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs] + ["-lc10", "-ltorch_cpu"])


def compiler() -> str:
    return os.environ.get("CXX", "g++")


def _precompiled(cxx: str, flags: list[str], folder: Path) -> list[str]:
    """Flags that make every source read torch's headers from one precompiled copy (about 6 s of each source's 10 s
    on 2 cores, parsed once instead of per source); none where the compiler cannot make one: each source then parses
    them itself (a compiler that cannot read the copy does the same)."""
    header = folder / "torch_headers.h"
    header.write_text("".join(f"#include <{h}>\n" for h in TORCH_HEADERS))
    compile_only = [f for f in flags if f != "-shared" and not f.startswith(("-L", "-l", "-Wl,"))]
    made = subprocess.run([cxx, "-x", "c++-header", str(header), "-o", f"{header}.gch", *compile_only],
                          capture_output=True, text=True, preexec_fn=dies_with_parent())
    return ["-include", str(header)] if made.returncode == 0 else []


def _build(flags: list[str] | None = None) -> Path:
    """The shared library for this source, torch and machine (or these compiler `flags`): compiled unless the cache
    has it."""
    flags = _flags() if flags is None else flags
    code = b"".join(p.read_bytes() for p in sorted(HERE.iterdir()) if p.is_file())  # sources and headers
    key = hashlib.sha256(code + torch.__version__.encode() + " ".join(flags).encode()).hexdigest()
    lib = hardware.cache_dir() / "native" / f"lab_{key[:16]}.so"
    if lib.exists():
        why = damaged(lib)
        if why is None:
            return lib
        log.warning("kernel library %s %s: building it again", lib, why)
    lib.parent.mkdir(parents=True, exist_ok=True)
    cxx = compiler()
    clear_stopped_builds(lib.parent)
    # built aside, then moved: no half-written library
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=f"{BUILDING}{os.getpid()}-") as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        pch = _precompiled(cxx, flags, Path(tmp))
        jobs = [running([cxx, "-c", str(src), "-o", str(o), *flags, *pch], stdout=subprocess.PIPE,
                        stderr=subprocess.PIPE, text=True) for src, o in zip(SOURCES, objects)]  # in parallel
        for job in jobs:
            _, err = job.communicate()
            if job.returncode:
                raise RuntimeError(f"{cxx} failed: {err.strip()[-2000:]}")
        out = Path(tmp) / lib.name
        done = subprocess.run([cxx, *map(str, objects), "-o", str(out), *flags], capture_output=True, text=True,
                              preexec_fn=dies_with_parent())
        if done.returncode:
            raise RuntimeError(f"{cxx} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, lib)
        sums = Path(tmp) / "sha256"
        sums.write_text(sha256(lib))
        os.replace(sums, checksum(lib))  # last: a library without it is built again
    return lib


def clear_stopped_builds(folder: Path) -> None:
    """Remove the folders of builds whose process is gone (killed mid-build: its compilers died with it)."""
    for old in folder.glob(f"{BUILDING}*"):
        pid = old.name.removeprefix(BUILDING).split("-")[0]
        if gone(pid):
            log.warning("removing %s, left by a build that was stopped", old)
            shutil.rmtree(old, ignore_errors=True)


def checksum(lib: Path) -> Path:
    """The file holding `lib`'s sha256 (hex), written once the library is whole."""
    return lib.with_suffix(".sha256")


def damaged(lib: Path) -> str | None:
    """Why the cached library `lib` cannot be used as it is (no checksum beside it, or one it does not match), or
    None."""
    try:
        want = checksum(lib).read_text().strip()
    except OSError:
        return "has no checksum beside it (written by an older build, or its build was stopped)"
    return None if want == sha256(lib) else "does not match its checksum (truncated or damaged)"


def _register_fakes() -> None:
    """Output shapes without running the kernels, for torch.compile's tracing."""
    fake = torch.library.register_fake
    fake("lab::rms_norm")(lambda x, w, eps: x.new_empty(x.shape))
    fake("lab::silu_mul")(lambda gu: gu.new_empty(gu.shape[0], gu.shape[1] // 2))
    fake("lab::rotary_")(lambda qk, cos, sin: None)
    fake("lab::write_rows_")(lambda dst, rows, src: None)
    fake("lab::decode_attention")(lambda q, k, v, bias, scale: q.new_empty(q.shape))
    fake("lab::token_attention")(lambda q, k, v, spans, rows, scale: q.new_empty(q.shape))
    for f in GGUF_FORMATS:
        fake(f"lab::{f}_pack")(lambda blocks: blocks.new_empty(blocks.shape))
        fake(f"lab::{f}_a8_pack")(lambda blocks: blocks.new_empty(blocks.shape))
        for kernel in ("", "_tiles", "_mm", "_a8"):
            fake(f"lab::{f}{kernel}_linear")(lambda x, w, bias, residual: x.new_empty(x.shape[0], w.shape[0]))
    fake("lab::layers")(lambda x, *rest: x.new_empty(x.shape))
    fake("lab::bf16_pack")(lambda w: w.new_empty(-(-w.shape[0] // 16) * 16 * w.shape[1], dtype=torch.bfloat16))
    fake("lab::bf16_linear")(lambda x, w, n, bias, residual: x.new_empty(x.shape[0], n, dtype=torch.float32))
    fake("lab::bf16_tiles_linear")(lambda x, w, n, bias, residual: x.new_empty(x.shape[0], n, dtype=torch.float32))
    fake("lab::bf16_mm_linear")(lambda x, w, n, bias, residual: x.new_empty(x.shape[0], n, dtype=torch.float32))
    fake("lab::fp32_pack")(lambda w: w.new_empty(-(-w.shape[0] // 16) * 16 * w.shape[1]))
    fake("lab::fp32_tiles_linear")(lambda x, w, n, bias, residual: x.new_empty(x.shape[0], n))
    for rows in ("q8_0_rows", "q8_0_a8_rows"):
        fake(f"lab::{rows}")(lambda w, ids: w.new_empty(ids.shape[0], w.shape[1] // 34 * 32, dtype=torch.float32))


def ops():
    """torch.ops.lab once the kernels are loaded, else None (the first failure logged, kept in `error`)."""
    global error, _loaded
    if not _loaded and error is None:
        try:
            torch.ops.load_library(str(_build()))
            _register_fakes()
            _loaded = True
        except Exception as exc:  # no compiler, a header torch does not ship...: ATen's operators instead
            error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            log.warning("fused CPU kernels unavailable; using ATen's operators: %s", error)
    return torch.ops.lab if _loaded else None


def capabilities() -> dict | None:
    """What the loaded build runs: {"isa": AVX512, AVX2 or scalar, "q4_1_vnni": Q4_1's integer products run here,
    "bf16_dot": the bf16 pairs multiply by vdpbf16ps here (else widened, FMA), "products": lab.layers' product kinds
    in enum order, "layer_weights": the names of one layer's weights lab.layers takes, in order (csrc/layer_weights.h)};
    None unbuilt."""
    lab = ops()
    if lab is None:
        return None
    isa, vnni, bf16, products, layer_weights = lab.capabilities()
    return {"isa": isa, "q4_1_vnni": vnni, "bf16_dot": bf16, "products": list(products),
            "layer_weights": list(layer_weights)}
