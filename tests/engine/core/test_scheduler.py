"""Model-free scheduler tests: hand-made runner outputs, one SchedulerOutput per step."""
import pytest

from engine.core.outputs import RunnerOutput
from engine.core.policies import make_scheduler
from engine.core.request import Request, SamplingParams, Status
from engine.specs import PolicySpec
from pipeline.config import policy_spec


def make(policy: dict, max_request_tokens: int):
    """A scheduler for a conf/policy entry, its missing knobs at their defaults."""
    return make_scheduler(policy_spec(policy), max_request_tokens)


def req(rid, prompt_len, max_new=4, arrival=0.0):
    return Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_new_tokens=max_new, ignore_eos=True),
                   arrival)


def step(s, now, token=7):
    """Schedule, pretend the runner sampled `token` for every sampling chunk, update; return the plan."""
    plan = s.schedule(now)
    s.update(plan, RunnerOutput({c.rid: token for c in plan.chunks if c.sample}), now)
    return plan


def test_chunked_budget_splits_prompts_like_vllm():
    s = make(PolicySpec.of("chunked", 8, token_budget=1024), 2048)
    for i in range(3):
        s.add(req(str(i), 800))
    first = step(s, 0.0)
    assert first.num_scheduled_tokens == {"0": 800, "1": 224}
    assert [c.sample for c in first.chunks] == [True, False]  # a cut prompt samples nothing yet
    second = step(s, 1.0)
    assert second.num_scheduled_tokens == {"0": 1, "1": 576, "2": 447}  # decodes first, then the cut prompt
    assert second.kind == "mixed"
    assert s.requests["1"].num_computed == 800 and s.requests["1"].output == [7]


def test_chunk_positions_continue_from_kv_so_far():
    s = make(PolicySpec.of("chunked", 2, token_budget=5), 64)
    s.add(req("a", 12))
    starts = [step(s, t).chunks[0].start for t in range(3)]
    assert starts == [0, 5, 10]


def test_static_admits_nothing_while_a_batch_runs_and_keeps_zombies():
    s = make(PolicySpec.of("static", 8, max_batch=2), 64)
    s.add(req("short", 3, max_new=1))
    assert step(s, 0.0).chunks == ()          # no deadline: a lone request waits
    s.add(req("long", 3, max_new=3))
    launch = step(s, 1.0)
    assert launch.new_ids == ("short", "long") and launch.kind == "prefill"
    s.add(req("late", 3))
    running = step(s, 2.0)
    assert running.new_ids == () and {c.rid for c in running.chunks} == {"short", "long"}
    assert [c.zombie for c in running.chunks] == [True, False]  # "short" finished: computed, discarded
    assert s.requests["short"].output == [7]
    step(s, 3.0)                                # "long" ends: the whole batch leaves
    assert s.running == [] and s.seats.num_free == 2
    assert step(s, 4.0).chunks == ()             # "late" alone: the next batch needs 2 again
    assert list(s.waiting) == [s.requests["late"]] and s.requests["late"].status is Status.WAITING


def test_dynamic_launches_at_the_deadline_with_what_is_there():
    s = make(PolicySpec.of("dynamic", 8, max_batch=4, max_wait_ms=50), 64)
    s.add(req("a", 3, arrival=0.0))
    assert s.schedule(0.049).chunks == ()
    assert s.wake_time(0.049) == pytest.approx(0.05)
    plan = s.schedule(0.05)
    assert plan.new_ids == ("a",)
    assert s.batch_sizes == [1]


def test_continuous_refills_a_freed_seat_on_the_next_step():
    s = make(PolicySpec.of("continuous", 2), 64)
    s.add(req("a", 3, max_new=1))
    s.add(req("b", 3, max_new=5))
    s.add(req("c", 3))
    first = step(s, 0.0)                       # prefill a, b; a finishes on its first token
    assert first.new_ids == ("a", "b")
    refill = step(s, 1.0)
    assert refill.new_ids == ("c",) and refill.chunks[0].seat == 0 and refill.kind == "prefill"
    assert step(s, 2.0).kind == "decode"


def test_mixed_puts_prompts_and_decodes_in_one_step():
    s = make(PolicySpec.of("mixed", 4), 64)
    s.add(req("a", 3))
    step(s, 0.0)
    s.add(req("b", 6))
    plan = step(s, 1.0)
    assert plan.num_scheduled_tokens == {"a": 1, "b": 6} and plan.kind == "mixed"


def test_bucketed_oracle_groups_by_true_length():
    s = make(PolicySpec.of("bucketed", 8, max_batch=2, max_wait_ms=0), 256)
    for rid, n in [("a", 10), ("b", 200), ("c", 12), ("d", 190)]:
        s.add(req(rid, 3, max_new=n))
    assert set(step(s, 0.0).new_ids) == {"a", "c"}


def test_naive_runs_one_at_a_time():
    s = make(PolicySpec.of("naive", 64), 64)
    s.add(req("a", 3, max_new=2))
    s.add(req("b", 3))
    assert step(s, 0.0).new_ids == ("a",)
    assert step(s, 1.0).new_ids == ()
    assert step(s, 2.0).new_ids == ("b",)


def test_abort_frees_the_seat_for_the_next_step():
    s = make(PolicySpec.of("continuous", 1), 64)
    s.add(req("a", 3, max_new=50))
    s.add(req("b", 3))
    step(s, 0.0)
    assert s.abort("a", 1.0).finish_reason == "abort"
    assert step(s, 1.0).new_ids == ("b",)


def test_unknown_policy_lists_the_choices():
    with pytest.raises(ValueError, match="chunked"):
        PolicySpec.of("fastest", 1)


def test_padded_static_batch_schedules_the_padding():
    s = make(PolicySpec.of("static", 8, max_batch=2, pad_prompts=True), 64)
    s.add(req("a", 3))
    s.add(req("b", 10))
    plan = step(s, 0.0)
    assert plan.num_pad_tokens == 7 and plan.total_tokens == 3 + 10 + 7
    assert s.seats.num_free == 0 and s.requests["a"].seat != plan.chunks[-1].seat
