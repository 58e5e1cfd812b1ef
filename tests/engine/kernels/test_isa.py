"""The isa switch (conf/isa/, pipeline/isa.py): a level composes its environment and kernel build, a process is executed
again once under it (native: never), a CPU without its units is refused, and the fingerprint and every report
header say when a run is emulated."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import MissingConfigException

from engine import hardware
from engine.kernels import build
from pipeline import isa
from pipeline.config import compose_config, group_entry
from pipeline.measuring.fingerprint import label

ROOT = Path(__file__).resolve().parents[3]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
AVX512 = {"avx2": True, "avx512f": True, "amx_tile": True}  # engine.hardware.cpu_info's flags of a CPU with AMX
AVX2_ONLY = {"avx2": True, "avx512f": False, "amx_tile": False}
AVX2_NEEDS = group_entry("isa", "avx2")["needs"]  # /proc/cpuinfo flags isa=avx2 asks of a CPU


@pytest.fixture
def clean(monkeypatch):
    """No level's variables in the environment, and no execution of the process again: it fails the test."""
    for v in (*isa.VARS, isa.REEXEC):
        monkeypatch.delenv(v, raising=False)

    def execve(*args):
        raise AssertionError(f"executed again: {args}")

    monkeypatch.setattr(os, "execve", execve)
    return monkeypatch


def test_avx2_composes_its_environment_and_kernel_build():
    level = compose_config(["isa=avx2"]).isa
    assert level.kernels == "AVX2" and dict(level.env) == AVX2_ENV
    assert isa.asked(level) == {**AVX2_ENV, build.BUILD_VAR: "AVX2"}
    assert isa.asked(compose_config([]).isa) == {}  # native, the default, sets nothing


def test_a_bad_isa_lists_the_options():
    with pytest.raises(MissingConfigException) as err:
        compose_config(["isa=avx3"])
    assert "Available options" in str(err.value) and "avx2" in str(err.value) and "native" in str(err.value)


def test_native_and_a_level_already_held_run_untouched(clean):
    isa.apply(compose_config([]).isa)
    clean.setenv(build.BUILD_VAR, "scalar")  # native narrows nothing and widens nothing
    isa.apply(compose_config([]).isa)
    clean.setattr(hardware, "cpu_units", lambda: set(AVX2_NEEDS))
    for k, v in {**AVX2_ENV, build.BUILD_VAR: "AVX2"}.items():
        clean.setenv(k, v)
    isa.apply(compose_config(["isa=avx2"]).isa)


def test_a_level_the_environment_lacks_executes_the_process_again_once(clean):
    calls = []
    clean.setattr(os, "execve", lambda *args: calls.append(args))
    clean.setattr(hardware, "cpu_units", lambda: set(AVX2_NEEDS))
    level = compose_config(["isa=avx2"]).isa
    isa.apply(level)
    (path, argv, env), = calls
    assert path == sys.executable and argv == sys.orig_argv
    assert {k: env.get(k) for k in (*AVX2_ENV, build.BUILD_VAR)} == {**AVX2_ENV, build.BUILD_VAR: "AVX2"}
    assert env[isa.REEXEC] == f"{os.getpid()}:avx2"
    clean.setenv(isa.REEXEC, env[isa.REEXEC])  # executed again, and still without the level's environment: no loop
    with pytest.raises(RuntimeError, match="still differs"):
        isa.apply(level)
    with pytest.raises(RuntimeError, match="needs a process of its own"):  # another level in the same process
        isa.apply(compose_config([]).isa)


def test_a_cpu_without_the_units_fails_naming_what_it_has(clean):
    clean.setattr(hardware, "cpu_units", lambda: {"sse4_2"})
    clean.setattr(hardware, "cpu_info", lambda: ("Old CPU, family 6 model 1", {"avx2": False}))
    with pytest.raises(ValueError) as err:
        isa.apply(compose_config(["isa=avx2"]).isa)
    assert str(AVX2_NEEDS) in str(err.value) and "Old CPU" in str(err.value) and "has no AVX2" in str(err.value)
    assert "['native', 'scalar']" in str(err.value)


def fingerprint(flags: dict, record: str) -> dict:
    return {"cpu": "CPU", "cpu_flags": flags, "isa": record, "threads": 2, "gpus": [], "torch": "2"}


def test_the_fingerprint_and_its_label_say_emulated(clean):
    assert isa.held(AVX512) == "native" and "(AMX)" in label(fingerprint(AVX512, "native"))
    for k, v in {**AVX2_ENV, build.BUILD_VAR: "AVX2"}.items():
        clean.setenv(k, v)
    emulated = isa.held(AVX512)
    assert emulated == ("avx2 (emulated: torch, MKL, oneDNN and the lab's kernels held to AVX2 on a CPU with "
                        "AVX-512)")
    assert label(fingerprint(AVX512, emulated)) == "CPU (AVX2, emulated on AVX-512), 2 threads, torch 2"
    native_avx2 = isa.held(AVX2_ONLY)  # the level on a CPU whose widest it is: not emulated
    assert "emulated" not in native_avx2 and label(fingerprint(AVX2_ONLY, native_avx2)).startswith("CPU (AVX2),")
    clean.delenv(build.BUILD_VAR)  # variables that match no level
    custom = isa.held(AVX512)
    assert custom.startswith("custom (ATEN_CPU_CAPABILITY=avx2") and "limited" in label(fingerprint(AVX512, custom))


@pytest.mark.slow  # a process that imports torch twice and may compile the kernels' AVX2 build
def test_a_process_under_avx2_runs_torch_and_the_kernels_at_avx2_and_says_so():
    if not set(AVX2_NEEDS) <= hardware.cpu_units():
        pytest.skip(f"this CPU lacks some of isa=avx2's units {AVX2_NEEDS}")
    code = ("import json, os, torch\n"
            "from pipeline.params import load\n"
            "from pipeline.measuring.fingerprint import environment\n"
            "from engine.kernels import build\n"
            "load(['isa=avx2'])\n"
            "fp = environment(1)\n"
            "print(json.dumps({'torch': torch.backends.cpu.get_cpu_capability(), 'pid': os.getpid(),\n"
            "                  'again': os.environ.get('LAB_ISA_REEXEC'), 'isa': fp['isa'], 'label': fp['label'],\n"
            "                  'mkl': os.environ.get('MKL_ENABLE_INSTRUCTIONS'),\n"
            "                  'kernels': (build.capabilities() or {}).get('isa')}))\n")
    env = {k: v for k, v in os.environ.items() if k not in (*isa.VARS, isa.REEXEC)}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["torch"] == "AVX2" and out["mkl"] == "AVX2" and out["again"] == f"{out['pid']}:avx2"
    if shutil.which(build.compiler()):
        assert out["kernels"] == "AVX2"
    assert out["isa"].startswith("avx2 (")
    if hardware.cpu_info()[1]["avx512f"]:
        assert "emulated" in out["isa"] and "(AVX2, emulated on AVX-512)" in out["label"]
