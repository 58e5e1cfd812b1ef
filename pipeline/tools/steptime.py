"""python -m pipeline.tools.steptime hardware=h100-sxm model=llama-3.1-8b-shape precision=bf16-cuda [a batch] [--json]

Computed step times (never measured) of a model at a precision on a spec sheet of conf/hardware. A batch is one of:
  decode=B context=C                B decode rows, each at C tokens of context (default 1024)
  chunks=N@P,N@P,...                prompt chunks of N tokens with P tokens before each (one step)
  batch=B input_tokens=L output_tokens=O [token_budget=T]
                                    B requests admitted together and run to the end under continuous batching
                                    (chunked at T tokens a step if given), as `vllm bench latency` times a batch
and `tp=N` splits the model over N devices; `kv_per_query_head=true` times a decode attention kernel that loads a K/V
head once for each query head it serves (TensorRT-LLM before v0.8's XQA kernel). The batch's K/V lives in what their
memory leaves after the weights (of 90 % of it, vLLM's default): requests that do not fit wait for others to finish.
It prints each step's time, bytes, FLOPs and the roof that binds; --json prints one JSON object instead (with
end_to_end_s and ttft_s for a batch)."""
import dataclasses
import sys

from omegaconf import OmegaConf

from pipeline.config import compose_config
from pipeline.modeling.batch import chunk_step, decode_step, run_batch
from pipeline.modeling.machines import fewest_devices, kv_tokens, spec_roofline
from pipeline.tools.args import run

OWN = {"decode", "context", "chunks", "batch", "input_tokens", "output_tokens", "token_budget", "tp",
       "kv_per_query_head"}


def _int(own: dict, key: str, default: int | None = None) -> int:
    value = own.get(key, default)
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise SystemExit(f"steptime: {key}={value!r} must be a whole number") from None
    if out < (0 if key == "context" else 1):
        raise SystemExit(f"steptime: {key}={out} must be >= 1")
    return out


def compute(own: dict, overrides: list[str]) -> dict:
    cfg = compose_config(overrides)
    roof = spec_roofline(cfg, _int(own, "tp") if "tp" in own else None)
    apart = str(own.get("kv_per_query_head", "false")).lower()
    if apart not in ("true", "false"):
        raise SystemExit(f"steptime: kv_per_query_head={apart!r} must be true or false")
    roof = dataclasses.replace(roof, kv_per_query_head=apart == "true")
    head = {"computed": True, "hardware": cfg.hardware.name, "model": cfg.model.name, "precision": cfg.precision.name,
            "tp": roof.tp, "kv_per_query_head": roof.kv_per_query_head, "efficiency": dataclasses.asdict(roof.eff),
            "calibrated_from": OmegaConf.to_container(cfg.hardware.efficiency.calibrated_from)}
    if "batch" in own:
        budget = _int(own, "token_budget") if "token_budget" in own else None
        memory = kv_tokens(roof, float(cfg.hardware.memory_gb))
        if memory <= 0:
            raise ValueError(f"{cfg.model.name}'s weights leave no room for K/V on {roof.tp} x {cfg.hardware.name}: "
                             f"add devices (tp={fewest_devices(cfg)} holds it)")
        return {**head, "kv_tokens": memory, **run_batch(roof, _int(own, "batch"), _int(own, "input_tokens", 128),
                                                         _int(own, "output_tokens", 128), budget, memory)}
    if "chunks" in own:
        try:
            pairs = [tuple(int(x) for x in c.split("@")) for c in own["chunks"].split(",")]
            chunks = [(n, p[0] if p else 0) for n, *p in pairs]
        except ValueError:
            raise SystemExit(f"steptime: chunks={own['chunks']!r}: write N@P,N@P (tokens @ tokens before)") from None
        plan = chunk_step(chunks)
    else:
        plan = decode_step(_int(own, "decode", 1), _int(own, "context", 1024))
    steps = [(len(c.tokens), c.start, c.sample) for c in plan.chunks]
    parts = roof.parts(steps)
    return {**head, "rows": len(steps), "tokens": sum(n for n, _, _ in steps), "step_s": roof.seconds(steps),
            "bytes": sum(p["bytes"] for p in parts.values()), "flops": sum(p["flops"] for p in parts.values()),
            "parts": parts}


def show(out: dict) -> str:
    eff = out["efficiency"]
    lines = [f"computed: {out['model']} at {out['precision']} on {out['hardware']} x{out['tp']} (efficiency: "
             f"{eff['bandwidth']:.0%} of the bandwidth, {eff['matrix']:.0%} of the matrix rate, "
             f"{eff['step_s'] * 1e3:g} ms a step; conf/hardware/{out['hardware']}.yaml names the runs they come from)"
             + ("; decode attention loads K/V once per query head" if out["kv_per_query_head"] else "")]
    if "end_to_end_s" in out:
        lines.append(f"batch {out['batch']} x {out['input_tokens']} in, {out['output_tokens']} out: end to end "
                     f"{out['end_to_end_s'] * 1e3:.1f} ms, TTFT {out['ttft_s'] * 1e3:.1f} ms, TPOT "
                     f"{out['tpot_s'] * 1e3:.2f} ms, {out['output_throughput_tps']:.0f} output tok/s, "
                     f"{out['steps']} steps")
        return "\n".join(lines)
    lines.append(f"{out['rows']} rows, {out['tokens']} tokens: step {out['step_s'] * 1e3:.3f} ms, "
                 f"{out['bytes'] / 1e9:.3f} GB moved, {out['flops'] / 1e12:.3f} TFLOP")
    for name, p in out["parts"].items():
        lines.append(f"  {name:<10} {p['seconds'] * 1e3:9.3f} ms  {p['bytes'] / 1e9:8.3f} GB  "
                     f"{p['flops'] / 1e12:8.3f} TFLOP  "
                     + (f"{p['bound']}-bound" if p["bound"] in ("memory", "compute") else p["bound"]))
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    """Print one step's or one batch's computed time; a SystemExit naming what is wrong otherwise."""
    run("steptime", __doc__, argv, OWN, compute, show)


if __name__ == "__main__":
    main(sys.argv[1:])
