"""The router's policies on the fleet as the router has seen it: outstanding requests and tokens, sessions, and the
prompts it sent each replica (SGLang's cache-aware rule and its defaults)."""
import pytest

from engine.router import POLICIES, Router, RouterSpec


def test_round_robin_takes_each_replica_in_turn():
    r = Router(RouterSpec("round_robin"), 3)
    assert [r.route(f"q{i}", [1, 2], 4) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_least_loaded_counts_outstanding_tokens_until_finished():
    r = Router(RouterSpec("least_loaded"), 2)
    assert r.route("big", [1] * 100, 100) == 0
    assert [r.route(f"s{i}", [1] * 10, 10) for i in range(3)] == [1, 1, 1]  # 200 tokens on 0, 20..60 on 1
    r.finished("big")
    assert r.route("next", [1] * 10, 10) == 0 and r.tokens == [20, 60]
    with pytest.raises(KeyError):
        r.finished("big")  # once only


def test_power_of_two_takes_the_less_loaded_of_its_two_draws():
    r = Router(RouterSpec("power_of_two", seed=1), 2)  # two replicas: both are drawn every time
    r.route("big", [1] * 1000, 1)
    assert {r.route(f"s{i}", [1], 1) for i in range(20)} == {1 - r.sent["big"][0]}
    again = Router(RouterSpec("power_of_two", seed=1), 5)
    same = Router(RouterSpec("power_of_two", seed=1), 5)
    assert [again.route(f"q{i}", [1], 1) for i in range(30)] == [same.route(f"q{i}", [1], 1) for i in range(30)]


def test_a_session_sticks_to_its_replica_however_loaded():
    r = Router(RouterSpec("session"), 2)
    first = r.route("t1", [1] * 500, 500, session="alice")
    assert r.route("t2", [2] * 5, 5, session="bob") != first  # a new session: the least loaded
    assert all(r.route(f"t{i}", [3], 1, session="alice") == first for i in range(3, 8))


def prompt(head: int, n: int, tail: int) -> list[int]:
    return [head] * n + list(range(1000 + tail, 1000 + tail + 64 - n))


def test_prefix_aware_follows_the_longest_prefix_above_the_threshold():
    r = Router(RouterSpec("prefix_aware", block_tokens=4), 3)
    assert r.route("a", prompt(7, 32, 0), 8) == 0
    assert r.route("b", prompt(8, 32, 1), 8) == 1  # no match: the least loaded
    assert r.route("c", prompt(7, 32, 2), 8) == 0  # half the prompt matches replica 0
    assert r.matched(0, prompt(7, 32, 3)) == 32 and r.matched(2, prompt(7, 32, 3)) == 0
    assert r.route("d", prompt(7, 16, 4), 8) == 2  # a quarter matches: under 0.3, the least loaded


def test_prefix_aware_balances_when_requests_are_out_of_balance():
    r = Router(RouterSpec("prefix_aware", block_tokens=4, balance_abs=3, balance_rel=1.5), 2)
    for i in range(4):
        assert r.route(f"hot{i}", prompt(7, 60, i), 1) == 0  # the same prefix: replica 0 every time
    assert r.requests == [4, 0]
    assert r.route("hot4", prompt(7, 60, 9), 1) == 1  # 4 apart > 3 and 4 > 1.5 x 0: the fewest requests


def test_the_prefix_index_forgets_the_least_recently_sent_beyond_its_tokens():
    r = Router(RouterSpec("prefix_aware", block_tokens=4, cache_tokens=64), 1)
    r.route("a", [1] * 64, 1)
    r.route("b", [2] * 32, 1)  # 8 new blocks: the index holds 16, a's oldest half goes
    assert r.matched(0, [2] * 32) == 32 and r.matched(0, [1] * 64) == 0  # a's chain broken at its first block


@pytest.mark.parametrize("bad", [{"policy": "random"}, {"block_tokens": 0}, {"cache_threshold": 2.0},
                                 {"balance_rel": 0.5}])
def test_a_bad_router_spec_names_what_to_choose(bad):
    with pytest.raises(ValueError) as err:
        RouterSpec(**bad)
    assert "router" in str(err.value) and (bad != {"policy": "random"} or str(list(POLICIES)) in str(err.value))


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_skips_replicas_down_or_tried_and_says_when_none_is_left(policy):
    r = Router(RouterSpec(policy, block_tokens=4), 3)
    r.down.add(1)
    assert {r.route(f"q{i}", prompt(7, 32, i), 8, session="s") for i in range(6)} <= {0, 2}
    assert r.route("t", prompt(7, 32, 9), 8, session="s", skip={0}) == 2
    with pytest.raises(LookupError, match="2 of 3 up, 2 tried"):
        r.route("u", [1], 1, skip={0, 2})
    assert "u" not in r.sent  # nothing recorded for a request not routed


def test_a_session_whose_replica_goes_down_moves_and_stays_moved():
    r = Router(RouterSpec("session"), 2)
    home = r.route("t1", [1], 1, session="alice")
    r.down.add(home)
    moved = r.route("t2", [1], 1, session="alice")
    r.down.clear()
    assert moved != home and r.route("t3", [1], 1, session="alice") == moved
