"""Shared fixtures: tiny random-weight models of two architectures, the real default model, and the servers over
a tiny chat model (tests.serving). `make test` runs the suite in two workers (pytest-xdist, one file per worker at a
time)."""
import os
import shutil
from dataclasses import replace
from pathlib import Path

if os.environ.get("PYTEST_XDIST_WORKER"):  # before torch loads OpenMP: two workers share the cores, so a thread that
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # waits at a barrier sleeps instead of spinning on a core
    # the other worker needs (spinning made the torch-bound tests 3-4x slower beside it; sleeping, 1.5x)

import pytest
import torch

from engine.factory import load_source
from engine.kernels import choice
from engine.specs import ModelSpec
from pipeline.config import model_spec
from tests.serving import BACKENDS, Server

ROOT = Path(__file__).resolve().parents[1]
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, len(os.sched_getaffinity(0)) // WORKERS)  # torch threads: each worker its share of the cores (two
# threads beside another worker stall at every parallel region's barrier, engine/threads.py)
TINY = ("tiny-llama", "tiny-qwen2")
LONGEST = "tests/pipeline/test_pipeline.py::test_dvc_repro_on_a_tiny_model"


def pytest_configure(config):
    torch.set_num_threads(THREADS)


def pytest_collection_modifyitems(config, items):
    """The whole pipeline's test first (the longest by far: the other worker runs the rest beside it); `gpu`-marked
    tests need CUDA: without it they are skipped, and the skip says so (pytest -rs)."""
    items.sort(key=lambda item: item.nodeid != LONGEST)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; torch sees none here (run them with `make gpu-check`)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def unmeasured_kernels(tmp_path_factory):
    """Every shape keeps a fixed kernel choice, unmeasured: timing the candidates on a real model's shapes costs
    minutes on a fresh machine and decides no test (tests/engine/kernels measure on purpose, SMALL_BYTES = 0). What
    the tests do measure goes to the session's copy of the machine's choices, shared by its workers: timed beside
    another worker, it never becomes the choice a benchmark runs."""
    machine, path = choice.cache_path(), choice.cache_path  # a test's own LAB_CACHE_DIR keeps its own file
    session = tmp_path_factory.getbasetemp()
    mine = (session.parent if os.environ.get("PYTEST_XDIST_WORKER") else session) / "kernels.json"
    if machine.exists() and not mine.exists():
        tmp = mine.with_suffix(f".{os.getpid()}.tmp")  # copied whole, then renamed: a worker reads all or nothing
        shutil.copyfile(machine, tmp)
        os.replace(tmp, mine)
    patch = pytest.MonkeyPatch()
    patch.setattr(choice, "SMALL_BYTES", float("inf"))
    timed = choice.measure  # a storage's own kernels (GGUF, bf16 blocks) are measured whatever their size: here they
    # take their row kernel up to 4 rows and their tiles beyond, unmeasured, unless a test measures (SMALL_BYTES = 0)
    patch.setattr(choice, "measure", lambda mats, device, names: timed(mats, device, names) if choice.SMALL_BYTES == 0
                  else {"choice": [names[0] if r <= 4 else names[1] for r in choice.BUCKETS], "ms": None})
    patch.setattr(choice, "cache_path", lambda: mine if path() == machine else path())
    yield
    patch.undo()


def model_cfg(name: str, **changes) -> ModelSpec:
    """conf/model/<name>.yaml as a record, with `changes`."""
    return replace(model_spec(name), **changes)


@pytest.fixture(scope="session", params=TINY)
def tiny(request):
    """(name, model) for each tiny architecture."""
    torch.set_num_threads(THREADS)
    model, _ = load_source(model_cfg(request.param))
    return request.param, model


@pytest.fixture(scope="session")
def tiny_llama():
    return load_source(model_cfg("tiny-llama"))[0]


@pytest.fixture(scope="session")
def smollm2():
    """The real default model, prepared from its GGUF package on first use."""
    from engine.model.loader import prepared

    cfg = model_cfg("smollm2-135m", path=str(ROOT / model_cfg("smollm2-135m").path))
    prepared(cfg)
    torch.set_num_threads(THREADS)
    return load_source(cfg)



@pytest.fixture(scope="session")
def smollm2_tokenizer_dir():
    """The folder with SmolLM2's tokenizer, prepared from its GGUF package on first use."""
    from engine.model.loader import prepared

    return prepared(model_cfg("smollm2-135m", path=str(ROOT / model_cfg("smollm2-135m").path)))


@pytest.fixture(scope="session")
def chat_model(smollm2_tokenizer_dir):
    cfg = model_cfg("tiny-chat", tokenizer=str(smollm2_tokenizer_dir))
    return load_source(cfg)

@pytest.fixture(params=list(BACKENDS))
def any_server(chat_model, request):
    with Server(*chat_model, BACKENDS[request.param]) as s:
        yield s


@pytest.fixture()
def server(chat_model):
    with Server(*chat_model, BACKENDS["engine"]) as s:
        yield s
