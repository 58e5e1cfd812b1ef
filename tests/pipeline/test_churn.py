"""The soak's verdict (pipeline/measuring/churn.py): each check fails on the run that breaks it, and a request cancelled
before its answer or mid-stream is counted the way the server may count it."""
from collections import Counter

from pipeline.measuring.churn import verdict


def rec(outcome: str, status: int | None = 200) -> dict:
    return {"outcome": outcome, "status": status}


def series(rss: list[float]) -> list[dict]:
    return [{"t_s": 10.0 * i, "rss_mb": r, "threads": 9, "open_files": 20} for i, r in enumerate(rss)]


FLAT = series([1000, 1010, 1020, 1020, 1021, 1019])
RUN = [rec("ok"), rec("ok"), rec("cancelled"), rec("cancelled", None)]  # one cancelled mid-stream, one before


def test_a_clean_run_passes_whichever_way_the_server_counted_the_cancels():
    for server in (Counter(stop=1, length=1, abort=1),             # the early cancel never reached it
                   Counter(stop=1, length=1, abort=2),             # it did, and was aborted
                   Counter(stop=1, length=2)):                     # the mid-stream one finished first
        out = verdict(RUN, FLAT, server, warmup_s=10)
        assert out["passed"], (server, out["checks"])
    assert out["rss_growth_ratio"] == 1020 / 1010  # the median of the last three samples over the first after warm-up


def test_each_check_fails_on_its_own_fault():
    server = Counter(stop=1, length=1, abort=1)
    faults = {
        "nothing lost or hung": (RUN + [rec("lost")], FLAT, server + Counter(length=1)),
        "no 5xx": (RUN + [rec("HTTP 503", 503)], FLAT, server),
        "no error events": (RUN, FLAT, server + Counter(error=1)),
        "resident memory within 5% of its value after the warm-up": (RUN, series([1000, 1000, 1060, 1070, 1080]),
                                                                     server),
        "the server's counts match the clients'": (RUN, FLAT, Counter(stop=1, abort=1)),  # a completion it never saw
    }
    for check, (recs, samples, counted) in faults.items():
        checks = verdict(recs, samples, counted, warmup_s=10)["checks"]
        assert not checks[check] and sum(not v for v in checks.values()) == 1, (check, checks)
