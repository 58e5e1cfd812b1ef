"""The fused fp32 CPU kernels (engine/kernels/csrc/native.cpp, fp32.cpp; attention's: test_attention.py): each equals
the ATen operators it replaces, the build says what it runs, the library is built once per machine, and a failed build
leaves the steps on ATen's operators."""
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import hardware
from engine.factory import build_net
from engine.kernels import build as native
from engine.model.hf import generate_alone
from engine.specs import PolicySpec
from pipeline.measuring.equivalence import ARRIVE, LENS, run_scenario, scenario_prompts

CXX = native.compiler()
HAS_CXX = shutil.which(CXX) is not None
lab = native.ops()
needs_lab = pytest.mark.skipif(lab is None, reason=f"the fused kernels did not build here: {native.error}")


def test_kernels_build_wherever_a_compiler_is():
    """Not a skip in disguise: with the compiler the build uses ($CXX, else g++) on the PATH, the kernels must build
    and load; without one there is nothing to build."""
    if not HAS_CXX:
        pytest.skip(f"no {CXX} on the PATH")
    assert lab is not None, native.error


@needs_lab
def test_capabilities_say_what_this_build_runs():
    """The build asked for ($LAB_KERNELS_BUILD, else the best this CPU runs), its fixed-point and bf16 paths where it
    and the CPU have them, and lab.layers' product kinds named as Python numbers them."""
    build = os.environ.get(native.BUILD_VAR) or native.builds()[0]
    flags = hardware.cpu_info()[1]
    caps = native.capabilities()
    assert {k: v for k, v in caps.items() if k != "layer_weights"} == {  # test_a_layers_weights_are_named_in_order
        "isa": build.split("-")[0], "q4_1_vnni": build == "AVX512-VNNI",
        "bf16_dot": build.startswith("AVX512") and flags["avx512_bf16"], "products": list(native.PRODUCTS)}


@needs_lab
def test_a_layers_weights_are_named_in_order():
    """lab.layers takes 14 weights a layer, named once in C++ (csrc/layer_weights.h): the two norms', then the weight,
    aux and bias of the qkv, o, gate_up and down products."""
    want = ["input_norm", "post_norm"] + [f"{p}.{part}" for p in ("qkv", "o", "gate_up", "down")
                                          for part in ("weight", "aux", "bias")]
    assert native.capabilities()["layer_weights"] == want and len(want) == 14


@needs_lab
@pytest.mark.parametrize("n", [576, 20, 7])  # a multiple of any vector width, and tails
def test_rms_norm_and_silu_mul_equal_aten(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(5, 2 * n, generator=g)[:, :n]  # rows strided
    w = torch.randn(n, generator=g)
    torch.testing.assert_close(lab.rms_norm(x, w, 1e-5), F.rms_norm(x, (n,), w, 1e-5))
    gu = torch.randn(5, 3 * n, generator=g)[:, :2 * n]  # gate then up, rows strided
    torch.testing.assert_close(lab.silu_mul(gu), F.silu(gu[:, :n]) * gu[:, n:])


@needs_lab
@pytest.mark.parametrize("d", [64, 24, 6])
def test_rotary_equals_the_swapped_halves_form(d):
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(4, 5 * d, generator=g)
    qk = qkv[:, :3 * d].view(4, 3, d)  # a view inside the fused projection's rows
    cos, sin = torch.randn(4, 1, d, generator=g), torch.randn(4, 1, d, generator=g)
    want = qk.view(4, 3, 2, d // 2).flip(2).view(qk.shape) * sin + qk * cos
    v = qkv[:, 3 * d:].clone()
    lab.rotary_(qk, cos[:, 0], sin[:, 0])
    torch.testing.assert_close(qk, want)
    assert torch.equal(qkv[:, 3 * d:], v)  # the rest of the row untouched


@needs_lab
@needs_lab
@pytest.mark.parametrize("n, k", [(40, 24), (16, 576), (7, 5)])  # whole tiles, tails of rows and of inputs
def test_fp32_tiles_equal_aten_and_each_row_is_summed_alone(n, k):
    """The fp32 tile product: x W^T + bias + residual as ATen gives it (strided rows of x too); a row's outputs are
    the same bits whatever rows are beside it."""
    torch.manual_seed(0)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(9, 2 * k)[:, :k]  # x: rows 2k apart
    res, tiles = torch.randn(9, n), lab.fp32_pack(w)
    assert torch.allclose(lab.fp32_tiles_linear(x, tiles, n, b, res), torch.addmm(b, x, w.t()) + res, atol=1e-4)
    assert torch.equal(lab.fp32_tiles_linear(x[4:5], tiles, n, None, None),
                       lab.fp32_tiles_linear(x, tiles, n, None, None)[4:5])
    with pytest.raises(RuntimeError, match="packed by fp32_pack"):
        lab.fp32_tiles_linear(x, tiles[:-1], n, None, None)


def test_kernels_refuse_what_they_do_not_compute():
    with pytest.raises(RuntimeError, match="float32 CPU"):
        lab.rms_norm(torch.ones(2, 4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="q \\[S, H, D\\]"):
        lab.decode_attention(torch.ones(2, 3, 8), torch.ones(2, 2, 4, 8), torch.ones(2, 2, 4, 8), None, 1.0)
    kv = torch.ones(3, 1, 4, 8)
    with pytest.raises(RuntimeError, match="span \\(1, 2, 5\\) of token 0 is not within 3 sequences of 4 keys"):
        lab.token_attention(torch.ones(1, 2, 8), kv, kv, torch.tensor([[1, 2, 5]]), None, 1.0)
    with pytest.raises(RuntimeError, match="span \\(0, 2, 2\\)"):  # no keys at all
        lab.token_attention(torch.ones(1, 2, 8), kv, kv, torch.tensor([[0, 2, 2]]), None, 1.0)
    with pytest.raises(RuntimeError, match="rows span \\[0, 12\\], beyond the cache's 12"):  # paged rows
        lab.token_attention(torch.ones(1, 2, 8), kv, kv, torch.tensor([[0, 0, 4]]), torch.arange(13)[9:].view(1, 1, 4),
                            1.0)


EMPTY = """
import torch
from engine.kernels import build as native
lab, z = native.ops(), torch.zeros
assert lab.rms_norm(z(2, 0), z(0), 1e-5).shape == (2, 0) and lab.silu_mul(z(2, 0)).shape == (2, 0)
lab.rotary_(z(1, 0, 4), z(1, 4), z(1, 4))
assert lab.first_argmax(z(0, 5)).shape == (0,)
assert lab.bf16_rms_norm(z(2, 0), z(0), 1e-5).shape == (2, 0) and lab.bf16_silu_mul(z(2, 0)).shape == (2, 0)
for f in ("q4_1", "q8_0"):  # products of no outputs, every kernel (the tile kernels' groups of no tiles)
    w = getattr(lab, f"{f}_pack")(torch.zeros(0, {"q4_1": 40, "q8_0": 68}[f], dtype=torch.uint8))
    for k in ("", "_tiles", "_mm"):
        assert getattr(lab, f"{f}{k}_linear")(z(3, 64), w, None, None).shape == (3, 0), (f, k)
for k in ("", "_tiles", "_mm"):
    assert getattr(lab, f"bf16{k}_linear")(z(3, 64), lab.bf16_pack(z(0, 64)), 0, None, None).shape == (3, 0), k
for q, kv in [(z(1, 3, 8), z(1, 1, 0, 8)), (z(1, 3, 8), z(1, 0, 4, 8))]:  # no keys; no kv heads
    try:
        lab.decode_attention(q, kv, kv, None, 1.0)
        raise SystemExit("decode_attention took an empty cache")
    except RuntimeError as e:
        assert "L at least 1" in str(e), e
no_dim = (z(1, 3, 0), z(1, 1, 4, 0), torch.zeros(1, 1, 4, dtype=torch.long))  # a paged cache's rows
for q, kv, rows in [no_dim, (z(1, 3, 8), z(1, 0, 4, 8), None)]:
    try:
        lab.token_attention(q, kv, kv, torch.tensor([[0, 0, 1]]), rows, 1.0)
        raise SystemExit("token_attention took an empty head")
    except RuntimeError as e:
        assert "D at least 1" in str(e), e
print("ok")
"""


@needs_lab
def test_empty_sizes_give_empty_results_or_a_clear_error():
    """Rows of no values, caches of no keys or heads: an empty result or a RuntimeError, never a division by zero
    that kills the process (run apart, so a crash fails this test alone)."""
    out = subprocess.run([sys.executable, "-c", EMPTY], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (out.returncode, out.stdout, out.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_CXX, reason=f"no {CXX} on the PATH")
def test_library_is_built_once_per_machine_and_again_when_damaged(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "SOURCES", native.SOURCES[:1])  # one object: the cache is under test, not the code
    monkeypatch.setattr(native, "_precompiled", lambda *a: [])  # for one source, precompiled headers save nothing
    popen, compiled = subprocess.Popen, []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: compiled.append(a) or popen(*a, **k))  # compiler runs
    flags = [f if f != "-O3" else "-O0" for f in native._flags()]  # unoptimised, likewise
    lib = native._build(flags)
    assert lib.parent == tmp_path / "native" and lib.stat().st_size > 0 and native.damaged(lib) is None
    assert sorted(lib.parent.iterdir()) == sorted([lib, native.checksum(lib)])  # nothing half-written beside it
    whole = lib.read_bytes()
    compiled.clear()
    assert native._build(flags) == lib and not compiled  # cached: nothing compiled again
    gone = int(open("/proc/sys/kernel/pid_max").read()) + 1  # no process has it: a build killed midway left this
    stopped = lib.parent / f"{native.BUILDING}{gone}-x1y2z3"
    stopped.mkdir()
    (stopped / "ops.o").write_bytes(b"half an object")
    for harm, said in ((lambda: lib.write_bytes(whole[:len(whole) // 2]), "does not match its checksum"),
                       (lambda: native.checksum(lib).unlink(), "has no checksum")):
        harm()
        with caplog.at_level("WARNING", logger=native.__name__):
            assert native._build(flags) == lib
        assert compiled and lib.read_bytes() == whole and native.damaged(lib) is None  # built again, whole
        assert f"kernel library {lib} {said}" in caplog.text and not stopped.exists()
        compiled.clear()


POLICIES = [PolicySpec.of("continuous", 3), PolicySpec.of("chunked", 3, token_budget=16)]


def scenario_tokens(model, net, policies):
    """([each policy's tokens for the scenario from an engine running `net`], [generate's over `model`, alone])."""
    prompts = scenario_prompts(model, None)
    runs = [run_scenario(net, policy, prompts, LENS, ARRIVE) for policy in policies]
    want = [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]
    return [[out[str(i)] for i in range(len(LENS))] for out in runs], [want] * len(policies)


def test_a_failed_build_leaves_aten_operators(tiny_llama, tmp_path, monkeypatch, caplog):
    """No compiler: ops() is None with the reason logged once and kept, and the model runs ATen's operators,
    giving generate's tokens."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "error", None)
    with caplog.at_level(logging.WARNING, logger="engine.kernels.build"):
        assert native.ops() is None and native.ops() is None
    assert "no-such-compiler" in native.error
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    net = build_net(tiny_llama)
    assert net.ops is None
    got, want = scenario_tokens(tiny_llama, net, [POLICIES[0]])
    assert got == want


@needs_lab
@pytest.mark.parametrize("fused", [True, False])
def test_both_paths_give_generates_tokens(tiny, fused):
    name, model = tiny
    net = build_net(model, native_kernels=fused)
    assert (net.ops is not None) == fused
    got, want = scenario_tokens(model, net, POLICIES)
    assert got == want, name
