"""The routing server in front of real engine servers (in-process, tiny-chat): the official client through it gets
what a replica gives, streamed and whole; the router's policy spreads the requests; replicas' errors pass through
as they were sent; a replica that cannot serve is skipped without losing the request."""
import httpx
import openai
import pytest

from engine.router import RouterSpec
from engine.specs import PolicySpec
from servers.router import create_router_app
from tests.serving import BACKENDS, Server, client, free_port, in_thread, metric, slow_steps, wait_for


class RouterServer:
    """The routing app on a loopback port in a thread, in front of `backends` (base URLs)."""

    def __init__(self, backends: list[str], policy: str = "round_robin", health_interval_s: float = 60.0):
        app = create_router_app(backends, RouterSpec(policy), default_max_tokens=16,
                                health_interval_s=health_interval_s)
        self.server, self.thread, self.url = in_thread(app)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture()
def pair(chat_model):
    with Server(*chat_model, BACKENDS["engine"]) as a, Server(*chat_model, BACKENDS["engine"]) as b:
        yield a, b


def ask(c, stream: bool, text="The capital of France is"):
    kw = dict(model="tiny-chat", messages=[{"role": "user", "content": text}], max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True})
    if not stream:
        return c.chat.completions.create(**kw).choices[0].message.content
    return "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw)
                   if ch.choices)


def test_the_client_through_the_router_gets_what_a_replica_gives_spread_in_turn(pair):
    a, b = pair
    direct = ask(client(a), False)
    with RouterServer([a.url, f"{b.url}/v1"]) as r:
        c = client(r)
        assert [ask(c, s) for s in (False, True, False, True)] == [direct] * 4
        done = c.completions.create(model="tiny-chat", prompt=[1, 2, 3, 4], max_tokens=3, temperature=0,
                                    extra_body={"ignore_eos": True})
        assert done.usage.completion_tokens == 3
        assert [m.id for m in c.models.list().data] == ["tiny-chat"]
        assert [metric(r.url, "lab:router_requests_total", replica=s.url, status="200") for s in pair] == [3, 2]
        health = httpx.get(f"{r.url}/health").json()
        assert health["status"] == "ok" and [x["up"] for x in health["replicas"]] == [True, True]
        assert [x["outstanding"] for x in health["replicas"]] == [0, 0]  # every request ended


def test_a_replicas_refusals_pass_through_and_a_bad_body_is_the_routers_400(chat_model):
    with Server(*chat_model, BACKENDS["engine"], max_waiting=0) as full, RouterServer([full.url]) as r:
        with pytest.raises(openai.RateLimitError) as err:
            ask(client(r), True)
        assert err.value.response.headers["retry-after"] == "1" and "queue is full" in err.value.message
        with pytest.raises(openai.BadRequestError, match="temperature"):
            client(r).chat.completions.create(model="tiny-chat", messages=[{"role": "user", "content": "hi"}],
                                              temperature=5)
        bad = httpx.post(f"{r.url}/v1/completions", content=b"[1, 2")
        assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
        assert httpx.post(f"{r.url}/v1/completions", json=[1]).status_code == 400


def test_a_replica_that_cannot_serve_is_skipped_and_nothing_is_lost(chat_model):
    with Server(*chat_model, PolicySpec.of("continuous", 2)) as good, \
            Server(*chat_model, PolicySpec.of("continuous", 2)) as draining:
        gone = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        with RouterServer([draining.url, gone, good.url]) as r:
            assert [x["up"] for x in httpx.get(f"{r.url}/health").json()["replicas"]] == [True, False, True]
            draining.worker.drain(30)  # its /health and new requests: 503, which the router has not polled yet
            assert [ask(client(r), s) for s in (True, False, True, False)] == [ask(client(good), False)] * 4
            assert metric(r.url, "lab:router_retries_total", replica=draining.url) == 1
            assert [x["up"] for x in httpx.get(f"{r.url}/health").json()["replicas"]] == [False, False, True]
            good.worker.drain(30)
            with pytest.raises(openai.APIStatusError) as err:
                ask(client(r), True)
            assert err.value.status_code == 503 and "shutting down" in err.value.message
            assert httpx.get(f"{r.url}/health").status_code == 503


def test_a_client_that_goes_away_mid_stream_is_aborted_on_its_replica(chat_model):
    with Server(*chat_model, BACKENDS["engine"]) as a, RouterServer([a.url]) as r:
        undo = slow_steps(a, 0.05)
        body = {"model": "tiny-chat", "prompt": "Once", "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{r.url}/v1/completions", json=body, timeout=30) as resp:
            next(resp.iter_lines())  # the first event came: the request runs on the replica
            assert a.worker.num_running == 1
        wait_for(lambda: a.worker.num_running == 0, 10, "the replica kept generating for a client that left")
        undo()
        wait_for(lambda: httpx.get(f"{r.url}/health").json()["replicas"][0]["outstanding"] == 0, 10,
                 "the router still counts the request as outstanding")


def test_a_replica_back_in_health_is_routed_to_again(chat_model):
    with Server(*chat_model, BACKENDS["engine"]) as a, RouterServer([a.url], health_interval_s=0.05) as r:
        a.worker.warming = True  # /health: 503 "warming up"
        wait_for(lambda: httpx.get(f"{r.url}/health").status_code == 503, 10, "the router did not see it down")
        a.worker.warming = False
        wait_for(lambda: httpx.get(f"{r.url}/health").status_code == 200, 10, "the router did not see it back")
        assert ask(client(r), False)
