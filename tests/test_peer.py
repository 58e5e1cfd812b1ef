"""The llama.cpp peer stage's parts that need no build: a built server is reused only for its own version, and the
report names the command and the ratios."""
import subprocess

import pytest

from pipeline import peer


def test_a_built_server_is_reused_for_its_version_only(tmp_path, monkeypatch):
    monkeypatch.setattr(peer, "PEERS", tmp_path)
    binary = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    (tmp_path / "llama.cpp" / "BUILT_FROM").write_text("0.3.36\n")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(OSError("no")))
    assert peer.build("0.3.36") == binary and not calls
    with pytest.raises(OSError):  # another version: the old build is removed and the new sdist fetched
        peer.build("0.3.37")
    assert not binary.exists() and "llama-cpp-python==0.3.37" in calls[0][0]


def test_the_report_names_the_command_and_the_ratios():
    row = {"requests": 4, "complete": 4, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3, "per_stream_tps": 50.0, "errors": 0}
    rows = [{**row, "backend": "llama.cpp", "concurrency": 1, "throughput_tps": 60.0},
            {**row, "backend": "engine-continuous", "concurrency": 1, "throughput_tps": 15.0}]
    settings = {"max_tokens": 256, "llama_cpp": "0.3.36", "gguf": "m.gguf", "seats": 64, "precision": "fp32",
                "command": ["llama-server", "-np", "64", "--no-cache-prompt"], "ratios": {1: 0.25}}
    md = peer.render(rows, settings, {"label": "a CPU", "id": "abc"})
    assert "`-np 64 --no-cache-prompt`" in md and "| 1 | 0.25 |" in md and "| llama.cpp | 1 | 4/4 |" in md
