"""The planner (pipeline.tools.plan): the fewest GPUs for a request rate at the SLO, computed on a spec sheet. More
requests never need fewer GPUs, the choice meets the SLO again on another seed's requests, and bad asks are refused
in one line."""
import json

import pytest

from pipeline.modeling.planner import Fleet, smallest
from pipeline.tools import plan

BASE = ["hardware=h100-sxm", "model=llama-3.1-8b-shape", "precision=bf16-cuda", "workload=azure-conv"]


def test_more_requests_never_need_fewer_gpus_and_the_choice_holds_on_another_seed(capsys):
    plan.main([*BASE, "rate=4,30,70", "routers=least_loaded", "splits=none,0.5", "budgets=2048", "requests=20",
               "seconds=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    best = [p["best"]["gpus"] for p in out["plans"]]
    print(f"GPUs at {[p['rate'] for p in out['plans']]} req/s: {best}")
    assert out["computed"] and best == sorted(best) and best[0] < best[-1] and out["best"] == out["plans"][-1]["best"]
    assert all(p["check"]["meets"] for p in out["plans"])
    for p in out["plans"]:
        gpus = [r["gpus"] for r in p["ranked"] if r["gpus"]]
        assert gpus == sorted(gpus) and {r["layout"] for r in p["ranked"]} == {"colocated", "split 0.5 prefill"}
        assert all(r["slo_met"] >= out["share"] and r["usd_per_m_output_tokens"] > 0 for r in p["ranked"])


@pytest.mark.parametrize("bad, said", [([], "rate=<req/s>"), (["rate=0"], "> 0"), (["rate=5", "routers=random"],
                                       "choose one of"), (["rate=5", "splits=1.5"], "strictly between"),
                                       (["rate=5", "hardware=cpu"], "spec sheet")])
def test_a_bad_ask_is_refused_in_one_line(bad, said):
    with pytest.raises(SystemExit) as err:
        plan.main([*BASE, *bad])
    assert said in str(err.value) and "\n" not in str(err.value)


def test_a_split_has_room_for_its_share():
    assert [smallest(s) for s in (None, 0.5, 0.25, 0.75, 1 / 3)] == [1, 2, 4, 4, 3]
    assert Fleet(4, prefill_share=0.25).parts == (1, 3) and Fleet(3, prefill_share=0.5).parts == (2, 1)
    with pytest.raises(ValueError, match="needs 4 replicas"):
        Fleet(2, prefill_share=0.25)
