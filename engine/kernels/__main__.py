"""`python -m engine.kernels` (make setup): this machine's native kernel library built once, before a stage measures
anything (engine/kernels/build.py; a stage builds it again only after the sources change)."""
from engine.kernels import build

built = build.capabilities()
if built:
    print(f"native kernels: {built['isa']} build (Q4_1 integer sums: {'yes' if built['q4_1_vnni'] else 'no'}, "
          f"bf16 pairs by vdpbf16ps: {'yes' if built['bf16_dot'] else 'no'})")
else:
    print(f"native kernels not built ({build.error}): the steps run torch's operators")
