"""Every kernel test file passes under each instruction-set build this CPU runs besides the suite's own (AVX-512
without VNNI, AVX2, scalar: engine/kernels/build.py's BUILDS): one pytest process per build, $LAB_KERNELS_BUILD
naming it, so that the model the tests run loads that build too. The bf16 product gives the same bits in every build
(vdpbf16ps where the CPU has AVX512-BF16, the pairs widened and summed with FMA elsewhere)."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import build as native

HERE = Path(__file__).parent
KERNEL_TESTS = ("test_native.py", "test_attention.py", "test_quant.py", "test_kquants.py", "test_kv_dtype.py",
                "test_bf16_cpu.py", "test_a8.py")  # under every build


OWN = os.environ.get(native.BUILD_VAR) or native.builds()[0]  # the suite's own build: its kernel tests ran already


@pytest.mark.slow
@pytest.mark.parametrize("build", [b for b in native.builds() if b != OWN])  # every other build this CPU runs
def test_kernel_tests_pass_under_each_build(build):
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          *(str(HERE / f) for f in KERNEL_TESTS)],
                         env={**os.environ, native.BUILD_VAR: build}, capture_output=True, text=True, timeout=1200)
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else run.stderr[-2000:]
    assert run.returncode == 0 and re.search(r"\d+ passed", summary), run.stdout[-4000:] + run.stderr[-2000:]
    print(f"{build}: {summary}")  # shown with -rP


PRODUCTS = """
import sys, torch
from engine.kernels import build
lab, (w, x, bias, res) = build.ops(), torch.load(sys.argv[1])
torch.save([lab.bf16_linear(x[:t], lab.bf16_pack(w), w.shape[0], *extra) for t in (1, 6, 64)
            for extra in ((None, None), (bias, res[:t]))], sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(native.ops() is None, reason="no fused kernels")
def test_bf16_products_are_the_same_bits_in_every_build(tmp_path):
    g = torch.Generator().manual_seed(5)
    inputs = (torch.randn(130, 1536, generator=g), torch.randn(64, 1536, generator=g) * 4,
              torch.randn(130, generator=g), torch.randn(64, 130, generator=g))
    torch.save(inputs, tmp_path / "in.pt")
    outs = {}
    for build in native.builds():
        run = subprocess.run([sys.executable, "-c", PRODUCTS, str(tmp_path / "in.pt"), str(tmp_path / f"{build}.pt")],
                             env={**os.environ, native.BUILD_VAR: build}, capture_output=True, text=True, timeout=1200)
        assert run.returncode == 0, run.stderr[-2000:]
        outs[build] = torch.load(tmp_path / f"{build}.pt")
    first, *rest = outs
    for build in rest:
        assert all(torch.equal(a, b) for a, b in zip(outs[first], outs[build])), (first, build)


KQUANTS = """
import sys, numpy as np, torch
from engine.kernels import build
from tests.engine.kernels.test_quant import random_blocks
lab, x = build.ops(), torch.load(sys.argv[1])
packs = {f: getattr(lab, f"{f}_pack")(torch.from_numpy(random_blocks(f, np.random.default_rng(0), 37, 512)))
         for f in ("q4_k", "q5_0", "q6_k")}
torch.save([getattr(lab, f"{f}{k}_linear")(x[:t], w, None, None) for f, w in packs.items() for k in ("", "_tiles")
            for t in (1, 6, 64)], sys.argv[2])
"""


@pytest.mark.slow
@pytest.mark.skipif(native.ops() is None, reason="no fused kernels")
def test_kquant_products_are_the_same_bits_in_every_vector_build(tmp_path):
    """Q4_K, Q5_0 and Q6_K's per-row and tiles products: the same bits under AVX-512 and AVX2 (FMA sums in one order;
    the scalar build rounds each product before its sum)."""
    torch.save(torch.randn(64, 512, generator=torch.Generator().manual_seed(6)), tmp_path / "x.pt")
    outs = {}
    for build in [b for b in native.builds() if b != "scalar"]:
        run = subprocess.run([sys.executable, "-c", KQUANTS, str(tmp_path / "x.pt"), str(tmp_path / f"{build}.pt")],
                             env={**os.environ, native.BUILD_VAR: build}, capture_output=True, text=True, timeout=1200,
                             cwd=HERE.parents[2])
        assert run.returncode == 0, run.stderr[-2000:]
        outs[build] = torch.load(tmp_path / f"{build}.pt")
    first, *rest = outs
    for build in rest:
        assert all(torch.equal(a, b) for a, b in zip(outs[first], outs[build])), (first, build)
