"""A step function through torch.compile, made on first use: Inductor's cache kept beside kernels.json, one graph
per step shape allowed, and eager from then on (the reason logged once, kept in `error`) where compiling fails."""
import logging
import os

import torch

from engine import hardware

log = logging.getLogger(__name__)


def keep_inductor_cache() -> None:
    """Inductor's cache beside kernels.json (kept across runs and reboots, unlike its default under /tmp), unless
    TORCHINDUCTOR_CACHE_DIR names another place (importing torch sets it to that default)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # Inductor only where steps compile
    from torch._inductor.utils import clear_caches

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(hardware.cache_dir() / "inductor")
        clear_caches()  # paths Inductor derived from the old place


class CompiledStep:
    def __init__(self, fn):
        self.fn = fn          # the eager step
        self.run = None       # fn through torch.compile, made on the first call
        self.error: str | None = None  # why the step fell back to eager, if it did

    def __call__(self, *args, static=lambda: (), cuda_graphs: bool = False):
        """fn(*args), compiled unless compiling failed once. static: gives, on the first call, the tensors whose
        addresses a CUDA graph keeps (written inside the graph); cuda_graphs: each shape captured once and replayed
        (mode "reduce-overhead")."""
        if self.error is not None:
            return self.fn(*args)
        if self.run is None:
            keep_inductor_cache()
            # a graph per step shape (row bucket, masked or not; with graphs, per padded shape): more than the default 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            torch.fx.experimental._config.use_duck_shape = False  # sizes equal by chance (rows, heads) stay apart
            for t in static() if cuda_graphs else ():
                torch._dynamo.mark_static_address(t)
            self.run = torch.compile(self.fn, dynamic=True, mode="reduce-overhead" if cuda_graphs else None)
        try:
            return self.run(*args)
        except Exception as exc:  # no C++ compiler, an operator Inductor cannot lower...: eager for good
            self.error = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
            log.warning("compiled steps failed; running them eager from now on: %s", self.error)
            return self.fn(*args)  # rewrites the same cache rows, if any were written
