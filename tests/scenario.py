"""Drive an engine through arrivals at given steps on a virtual clock of 1 s per step (for deadline policies)."""
from engine import LLMEngine, SamplingParams
from engine.loader import eos_ids


def run_scenario(model, policy: dict, prompts, lens, arrive: dict[int, list[int]], capacity: int = 256,
                 runner_cls=None, max_steps: int = 5000) -> dict[str, list[int]]:
    clock = [0.0]
    eng = LLMEngine(model, policy, capacity, eos_ids=eos_ids(model), clock=lambda: clock[0])
    if runner_cls is not None:
        eng.runner.__class__ = runner_cls
    reqs, step = {}, 0
    while step < max_steps and (step <= max(arrive) or eng.has_work()):
        for i in arrive.get(step, []):
            reqs[str(i)] = eng.add_request(str(i), prompts[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True))
        eng.step()
        clock[0] += 1.0
        step += 1
    assert not eng.has_work(), f"{policy['name']} did not finish in {max_steps} steps"
    return {rid: r.output for rid, r in reqs.items()}
