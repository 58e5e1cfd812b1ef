"""A batch timed as `vllm bench latency` and TensorRT-LLM's benchmarks time one: B requests of L_in prompt tokens
admitted together and run to L_out output tokens each under continuous batching, the real scheduler on a virtual
clock whose steps cost what a Roofline computes. Also the single steps a user may ask for: B decode rows at a context,
or prompt chunks at their contexts."""
from engine import SamplingParams
from engine.core.outputs import ScheduledChunk, SchedulerOutput
from engine.core.simulator import SimRunner, VirtualClock
from engine.factory import build_engine
from engine.specs import KVSpec, PolicySpec
from pipeline.config import kv_spec
from pipeline.modeling.roofline import Roofline

BLOCK = 16  # tokens per K/V block where the memory, not the batch, limits the requests running

def decode_step(rows: int, context: int) -> SchedulerOutput:
    """`rows` decodes, each at `context` tokens (its new token included)."""
    return SchedulerOutput(tuple(ScheduledChunk(f"d{i}", context - 1, (0,), sample=True) for i in range(rows)))


def chunk_step(chunks: list[tuple[int, int]]) -> SchedulerOutput:
    """Prompt chunks of (tokens, tokens before them), each sampling at its end."""
    return SchedulerOutput(tuple(ScheduledChunk(f"p{i}", past, (0,) * n, sample=True, prompt=True)
                                 for i, (n, past) in enumerate(chunks)))


def run_batch(roof: Roofline, batch: int, input_tokens: int, output_tokens: int, token_budget: int | None = None,
              kv_tokens: float | None = None) -> dict:
    """B requests admitted at t = 0 and run to the end: end_to_end_s (first prompt token to last output token),
    ttft_s (the last of the batch's first tokens), tpot_s (mean s per output token after the first), the steps and
    output throughput. token_budget: prompts chunked at that many tokens a step (chunked policy), else whole;
    kv_tokens: the K/V tokens the devices' memory holds (a paged pool of that many; those that do not fit wait).
    Where every request fits and prompts go whole, the continuous scheduler's plans are known ahead (one step of
    every prompt, then every row decoding at one more token of context each step): their times are summed directly
    (`batch_plans`, the same plans; tests check both ways agree), else the scheduler runs on the virtual clock."""
    need = batch * (input_tokens + output_tokens)
    if kv_tokens is not None and kv_tokens < input_tokens + output_tokens:
        raise ValueError(f"one request of {input_tokens + output_tokens} tokens needs more K/V than the memory holds "
                         f"({kv_tokens:.0f} tokens once the weights are in): add devices (tp) or shorten it")
    if token_budget is None and (kv_tokens is None or kv_tokens >= need):
        times = [roof.seconds(chunks) for chunks in batch_plans(batch, input_tokens, output_tokens)]
        return _summary(batch, input_tokens, output_tokens, times[0], sum(times), len(times))
    kv = paged_pool(kv_tokens, prefix_caching=False) if kv_tokens is not None and kv_tokens < need else "slot"
    return scheduled_batch(roof, batch, input_tokens, output_tokens, token_budget, kv)


def paged_pool(tokens: float, prefix_caching: bool = True) -> KVSpec:
    """A paged pool of BLOCK-token blocks holding `tokens` (the memory's K/V room)."""
    return kv_spec("paged", block_size=BLOCK, num_blocks=int(tokens // BLOCK), prefix_caching=prefix_caching)


def scheduled_batch(roof: Roofline, batch: int, input_tokens: int, output_tokens: int,
                    token_budget: int | None = None, kv="slot") -> dict:
    """run_batch through the real scheduler on a virtual clock (kv: a KV record or a conf/kv name)."""
    clock = VirtualClock()
    policy = PolicySpec.of("chunked", batch, token_budget=token_budget) if token_budget else \
        PolicySpec.of("continuous", batch)
    eng = build_engine(None, policy, input_tokens + output_tokens, runner=SimRunner(roof, clock), clock=clock,
                       kv=kv_spec(kv))
    params = SamplingParams(max_new_tokens=output_tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request(f"b{i}", [0] * input_tokens, params)
    first, steps = {}, 0
    while eng.has_work():
        for e in eng.step():
            first.setdefault(e.rid, clock())
        steps += 1
    return _summary(batch, input_tokens, output_tokens, max(first.values()), clock(), steps)


def batch_plans(batch: int, input_tokens: int, output_tokens: int):
    """The continuous scheduler's steps for B equal requests admitted together with room for all: every prompt in
    one step, then O - 1 steps of B decodes, as (tokens, tokens before, samples?, rows) groups."""
    yield [(input_tokens, 0, True, batch)]
    for i in range(1, output_tokens):
        yield [(1, input_tokens + i - 1, True, batch)]


def _summary(batch: int, input_tokens: int, output_tokens: int, ttft: float, end: float, steps: int) -> dict:
    return {"batch": batch, "input_tokens": input_tokens, "output_tokens": output_tokens, "end_to_end_s": end,
            "ttft_s": ttft, "tpot_s": (end - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0,
            "steps": steps, "output_throughput_tps": batch * output_tokens / end}
