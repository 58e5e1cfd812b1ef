"""The llama.cpp peer's parts that need no build: its flags follow the CPU held to the isa level's units with AMX
off, each level builds in a folder of its own and a build is reused only for its own version and flags, and its
command line."""
import json
import subprocess

import pytest
from omegaconf import OmegaConf

from pipeline.config import ROOT
from pipeline.tools.peers import llama_cpp, report

AVX512 = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8"}


def test_build_flags_follow_the_cpu_and_keep_amx_off():
    flags = llama_cpp.cpu_flags({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"})
    assert "-DGGML_AVX512=ON" in flags and "-DGGML_AVX512_VNNI=ON" in flags and "-DGGML_AVX512_BF16=OFF" in flags
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(flags)
    assert "-DGGML_AVX512=OFF" in llama_cpp.cpu_flags({"avx", "avx2", "fma", "f16c"})


def test_isa_avx2_builds_avx2_only_on_an_avx512_cpu():
    flags = llama_cpp.cpu_flags(AVX512, unit="AVX2")
    assert {"-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"} <= set(flags)
    assert not [f for f in flags if f.endswith("=ON") and ("512" in f or "VNNI" in f or "AMX" in f)]
    assert not [f for f in llama_cpp.cpu_flags(AVX512, unit="no AVX2") if f.endswith("=ON")]


def built(peers, level: str, flags: list[str]):
    out = peers / "llama.cpp" / f"build-{level}"
    (out / "bin").mkdir(parents=True)
    (out / "bin" / "llama-server").write_text("#!/bin/sh\necho version: 1\n")
    (out / "bin" / "llama-server").chmod(0o755)
    (out / "BUILT_FROM").write_text(json.dumps({"version": "0.3.36", "flags": [*llama_cpp.CMAKE, *flags]}) + "\n")
    return out / "bin" / "llama-server"


def test_each_level_keeps_its_own_build_reused_for_its_version_and_flags_only(tmp_path, monkeypatch):
    (tmp_path / "llama.cpp").mkdir()
    (tmp_path / "llama.cpp" / "SOURCE").write_text("0.3.36\n")
    native = built(tmp_path, "native", ["-DGGML_AVX512=ON"])
    avx2 = built(tmp_path, "avx2", ["-DGGML_AVX512=OFF"])
    calls = building(monkeypatch)
    assert llama_cpp.build("0.3.36", tmp_path, ["-DGGML_AVX512=ON"], "native") == (
        native, [*llama_cpp.CMAKE, "-DGGML_AVX512=ON"]) and not calls
    assert llama_cpp.build("0.3.36", tmp_path, ["-DGGML_AVX512=OFF"], "avx2")[0] == avx2 and not calls
    with pytest.raises(OSError):  # other flags for avx2: its folder rebuilt from the kept source, native's untouched
        llama_cpp.build("0.3.36", tmp_path, ["-DGGML_AVX2=OFF"], "avx2")
    assert not avx2.exists() and native.exists() and calls[0][0][:2] == ["cmake", "-S"]
    assert str(avx2.parent.parent) in calls[0][0]


def test_another_version_fetches_its_sdist_again(tmp_path, monkeypatch):
    (tmp_path / "llama.cpp").mkdir()
    (tmp_path / "llama.cpp" / "SOURCE").write_text("0.3.36\n")
    native = built(tmp_path, "native", [])
    calls = building(monkeypatch)
    with pytest.raises(OSError):
        llama_cpp.build("0.3.37", tmp_path, [], "native")
    assert not native.exists() and "llama-cpp-python==0.3.37" in calls[0][0]


def test_a_build_that_does_not_run_is_built_again(tmp_path, monkeypatch, caplog):
    (tmp_path / "llama.cpp").mkdir()
    (tmp_path / "llama.cpp" / "SOURCE").write_text("0.3.36\n")
    native = built(tmp_path, "native", [])
    native.write_bytes(b"\x7fELF\x02\x01")  # cut short
    calls = building(monkeypatch)
    with pytest.raises(OSError):
        llama_cpp.build("0.3.36", tmp_path, [], "native")
    assert calls[0][0][:2] == ["cmake", "-S"] and "llama-server (native) does not run" in caplog.text


def building(monkeypatch) -> list:
    """subprocess.run recorded and failing, but for a binary's --version: the commands a build would run."""
    real, calls = subprocess.run, []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: real(*a, **k) if a[0][-1] == "--version"
                        else calls.append(a) or (_ for _ in ()).throw(OSError("no")))
    return calls


def test_the_server_runs_continuous_batching_without_a_prompt_cache(tmp_path):
    p = OmegaConf.create({"slots": 64, "ctx_per_slot": 512})
    args = llama_cpp.command(tmp_path / "llama-server", tmp_path / "m.gguf", p, 2, 8080)
    assert args[args.index("-np") + 1] == "64" and args[args.index("-c") + 1] == str(64 * 512)
    assert {"--cont-batching", "--no-cache-prompt"} <= set(args) and args[args.index("-t") + 1] == "2"


def test_the_peer_names_the_files_quantization_and_another_model_reports_beside_its_own():
    assert llama_cpp.precision_of("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1 (llama.cpp)"
    assert llama_cpp.precision_of("gemma-3-270m-q4_k_m.gguf") == "Q4_K_M (llama.cpp)"
    assert report.reports_for("smollm2-135m") == ROOT / "reports"
    assert report.reports_for("gemma3-270m") == ROOT / "reports" / "models" / "gemma3-270m"
