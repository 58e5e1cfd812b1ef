"""Every kernel test file passes under each instruction-set build this CPU runs besides the suite's own (AVX-512
without VNNI, AVX2, scalar: engine/kernels/build.py's BUILDS): one pytest process per build, $LAB_KERNELS_BUILD
naming it, so that the model the tests run loads that build too."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import build as native

HERE = Path(__file__).parent
KERNEL_TESTS = ("test_native.py", "test_quant.py", "test_kv_dtype.py", "test_bf16_cpu.py")  # under every build


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
