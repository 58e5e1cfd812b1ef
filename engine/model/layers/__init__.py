"""The pieces a decoder is made of, each picking its implementation (native kernel or ATen) once, when built:
linear (the weight storages), norm, rotary, mlp, attention (a step's attention paths)."""
