"""Every side's accuracy on the lab's stream (pipeline/tools/peers/logprobs.py) and the tiers PEER.md sets them in
(tiers.py): the top-k bound is zero for the reference's own distribution and for a shifted copy (a peer's float32
log-softmax), below the whole KL otherwise; peers' answers parsed from their servers' JSON; levels placed by the
lab's lossless rule and near_lossless_kld, each tier's fastest taken among the levels at least that accurate."""
import json

import httpx
import torch

from pipeline.config import ROOT, compose_config
from pipeline.tools.peers import logprobs
from pipeline.tools.peers.logprobs import Judge, llama_tops, top_k, vllm_tops
from pipeline.tools.peers.report import render, reports_for
from pipeline.tools.peers.tiers import tier, tier_rule, tiered


def judge(logits: torch.Tensor, k: int = 5) -> Judge:
    j = Judge.__new__(Judge)
    j.k, j.near_tie, j.seqs = k, 1e-3, [list(range(logits.shape[0] + 1))]
    j.hold([logits])
    return j


def test_the_bound_is_zero_for_fp32_itself_and_a_shifted_copy_and_below_the_whole_kl():
    torch.manual_seed(0)
    ref = torch.randn(40, 64) * 3
    j = judge(ref)
    ids, lp = top_k(ref, j.k)
    assert j.score([(ids, lp)])["kld_mean"] < 1e-15
    shifted = j.score([(ids, lp.float().double() - 1e-3)])  # a common shift and float32 rounding
    assert shifted["kld_mean"] < 1e-12 and shifted["top1"] == 1.0
    other = ref + torch.randn(40, 64) * 0.3
    got = j.score([top_k(other, j.k)])
    p, q = ref.double().log_softmax(-1), other.double().log_softmax(-1)
    whole = (p.exp() * (p - q)).sum(-1).mean().item()
    assert 0 < got["kld_mean"] <= whole and got["positions"] == 40
    assert got["top1"] == (ref.argmax(-1) == other.argmax(-1)).float().mean().item()


def test_a_peers_answers_are_read_from_its_servers_json(monkeypatch):
    seq = [5, 6, 7]

    def vllm(url, json, timeout):
        assert json["prompt"] == seq and json["prompt_logprobs"] == 2
        entry = {"1": {"logprob": -0.1}, "2": {"logprob": -3.0}, "9": {"logprob": -7.0}}  # its own token added
        return httpx.Response(200, json={"choices": [{"prompt_logprobs": [None, entry, entry]}]},
                              request=httpx.Request("POST", url))
    monkeypatch.setattr(logprobs.httpx, "post", vllm)
    ids, lp = vllm_tops("http://x/v1", [seq], 2)[0]
    assert ids.tolist() == [[1, 2], [1, 2]] and lp.tolist() == [[-0.1, -3.0], [-0.1, -3.0]]

    prefixes = []

    def llama(request):
        body = json.loads(request.content)
        prefixes.append(body["prompt"])
        assert body["n_predict"] == 1 and body["n_probs"] == 2 and body["cache_prompt"]
        return httpx.Response(200, json={"completion_probabilities": [
            {"id": 4, "top_logprobs": [{"id": 4, "logprob": -0.2}, {"id": 8, "logprob": -2.0}]}]})
    client = httpx.Client
    monkeypatch.setattr(logprobs.httpx, "Client", lambda **kw: client(transport=httpx.MockTransport(llama), **kw))
    ids, lp = llama_tops("http://x", [seq], 2)[0]
    assert prefixes == [[5], [5, 6]] and ids.tolist() == [[4, 8], [4, 8]]


def test_an_error_from_a_peer_is_kept_in_its_place():
    def broken(seqs, k):
        raise httpx.ConnectError("refused")
    got = judge(torch.zeros(3, 8)).fetched(broken, "its server")
    assert got == {"error": "ConnectError: refused", "through": "its server"}
    assert tier(got, {}) is None


RULE = {**tier_rule(compose_config([])), "floor": {"kld_mean": 1e-11, "through": "fp32 through the packed product"},
        "stream": "a stream", "sequences": 8, "top_k": 20}


def tf(kld: float, top1: float = 1.0, **kw) -> dict:
    return {"kld_mean": kld, "kld_p99": 2 * kld, "top1": top1, "top1_no_ties": top1, "positions": 2040,
            "through": "x", **kw}


def test_levels_are_placed_by_the_labs_rule():
    assert tier(tf(5e-11), RULE) == "lossless"
    assert tier(tf(5e-11, top1=0.99), RULE) == "near-lossless"  # top-1 below lossless_top1
    assert tier(tf(2e-10), RULE) == "near-lossless"  # over 10x the floor
    assert tier(tf(2e-3), RULE) == "lossy"


def run_rows() -> list[dict]:
    def r(backend, precision, mode, tps, acc):
        return {"backend": backend, "precision": precision, "mode": mode, "concurrency": 1, "throughput_tps": tps,
                "requests": 4, "complete": 4, "ttft_p50_s": 0.1, "ttft_p99_s": 0.1, "per_stream_tps": tps,
                "errors": 0, "teacher_forced": acc}
    return [r("vLLM", "float32", "server", 30.0, tf(2e-11)), r("vLLM", "bfloat16", "server", 40.0, tf(2e-4)),
            r("llama.cpp", "Q4_1 (llama.cpp)", "server", 100.0, tf(2e-3)),
            r("lab (engine server)", "w4", "server", 90.0, tf(3e-11)),
            r("lab (engine server)", "w4a8", "server", 120.0, tf(3e-3)),
            r("OpenVINO GenAI", "int4", "in-process", 80.0, tf(0.2, estimated=True)),
            r("lab (engine in-process)", "w4", "in-process", 85.0, tf(3e-11))]


def test_each_tier_sets_the_fastest_level_at_least_that_accurate_on_each_side():
    got = {(q["tier"], q["mode"]): q for q in tiered(run_rows(), RULE, "lab")}
    lossless, near, lossy = (got[t, "server"] for t in ("lossless", "near-lossless", "lossy"))
    assert (lossless["lab"]["precision"], lossless["peer"]["precision"], lossless["ratio"]) == ("w4", "float32", 3.0)
    assert (near["lab"]["precision"], near["peer"]["precision"]) == ("w4", "bfloat16")  # lossless counts here too
    assert (lossy["lab"]["precision"], lossy["peer"]["precision"], lossy["ratio"]) == ("w4a8", "Q4_1 (llama.cpp)",
                                                                                       1.2)
    assert got["lossless", "in-process"]["peer"] is None and got["lossy", "in-process"]["ratio"] == 85.0 / 80.0


def test_peer_md_shows_each_levels_accuracy_once_and_the_tier_table():
    settings = {"n": 4, "max_tokens": 256, "levels": [1], "isa": "native", "unit": None, "peers": {},
                "lab": "the engine", "freeze": "unchanged", "accuracy": RULE}
    rows = run_rows()
    rows.append({**rows[3], "concurrency": 16})  # one level's accuracy, whatever the concurrency
    rows.append({**rows[5], "precision": "int8", "throughput_tps": 0.0})  # its run failed
    refused = [{"backend": "vLLM", "precision": "bfloat16", "mode": "server", "reason": "no"}]
    md = render(rows, refused, settings, {"label": "a CPU", "id": "abc"}, None, others=["isa/avx2/PEER.md"])
    assert md.count("| lab | w4 | x | 2040 | 3.00e-11 |") == 1
    assert "| OpenVINO GenAI | int4 | x | 2040 | 2.00e-01 | 4.00e-01 | 100.00% | 100.00% | lossy (estimated) |" in md
    assert "| lossy | in-process | 1 | w4 | 85.0 | OpenVINO GenAI int4 (estimated) | 80.0 | 1.06 |" in md
    assert "| lossless | in-process | 1 | w4 | 85.0 | none | n/a | n/a |" in md
    assert "[isa/avx2/PEER.md](isa/avx2/PEER.md)" in md
    assert "measured here): vLLM bfloat16, OpenVINO GenAI int8." in md
    rows[5]["units"] = "on every unit this CPU has, not AVX2"  # a peer an isa level could not hold
    md = render(rows, refused, {**settings, "isa": "avx2", "unit": "AVX2"}, {"label": "a CPU", "id": "abc"}, None)
    assert "| OpenVINO GenAI int4 (estimated; on every unit this CPU has, not AVX2) | 80.0 | 1.06 |" in md


def test_a_run_under_another_isa_level_keeps_its_own_folder():
    assert reports_for("smollm2-135m", "avx2") == ROOT / "reports" / "isa" / "avx2"
    assert reports_for("gemma3-270m", "avx2") == ROOT / "reports" / "models" / "gemma3-270m" / "isa" / "avx2"
    assert reports_for("smollm2-135m") == ROOT / "reports"
