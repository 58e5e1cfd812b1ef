"""The native CPU kernels: building the C++ library (build.py, sources in csrc/), ATen's packed products as operators
(aten.py) and choosing each matrix product per machine (choice.py). Imports nothing of engine.core or engine.model."""
