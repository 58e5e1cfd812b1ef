"""The native CPU kernels: building the C++ library (build.py, sources in csrc/), ATen's packed products as operators
(aten.py) and choosing each matrix product per machine (choice.py). Imports nothing of engine.core or engine.model.
The environment variables that hold them to an instruction set are named here (read without importing torch)."""

BUILD_VAR = "LAB_KERNELS_BUILD"  # one of build.BUILDS to build and load instead of the best
ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")  # env vars that narrow kernels
