"""The fused fp32 CPU kernels (engine/kernels/csrc/native.cpp, decode_attention.cpp): each equals the ATen operators
it replaces, masked keys are never read, the build says what it runs, the library is built once per machine, and a
failed build leaves the steps on ATen's operators."""
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine import machine
from engine.kernels import build as native
from engine.model.forward import FlatModel
from engine.model.hf import generate_alone
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
    flags = machine.cpu_info()[1]
    caps = native.capabilities()
    assert caps == {"isa": build.split("-")[0], "q4_1_vnni": build == "AVX512-VNNI",
                    "bf16_dot": build.startswith("AVX512") and flags["avx512_bf16"], "products": list(native.PRODUCTS)}


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


def reference_attention(q, k, v, bias, scale):
    S, KV, L, D = k.shape
    scores = torch.einsum("skgd,skld->skgl", q.view(S, KV, -1, D), k) * scale
    if bias is not None:
        scores = scores + bias[:, None, None, :]
    return torch.einsum("skgl,skld->skgd", scores.softmax(-1), v).reshape(q.shape)


@needs_lab
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (4, 4, 16), (14, 2, 64), (8, 1, 128), (6, 2, 20)])
@pytest.mark.parametrize("masked", [None, "tail", "window"])
def test_decode_attention_equals_softmax_attention(heads, kv, d, masked):
    """GQA groups of 1 to 8 query heads (remainders past 4), head dims that are and are not whole vectors, keys a
    strided view of a larger cache; masked keys (each sequence's tail, or all but a sliding window of 6, so blocks
    of keys mix masked and read ones) hold NaN, which must never be read."""
    g = torch.Generator().manual_seed(heads * d)
    S, L, cap = 5, 37, 50
    cache_k, cache_v = torch.randn(S + 2, kv, cap, d, generator=g), torch.randn(S + 2, kv, cap, d, generator=g)
    k, v = cache_k[:S, :, :L], cache_v[:S, :, :L]
    q = torch.randn(S, heads, d, generator=g)
    bias = None
    if masked:
        lens, j = torch.tensor([1, 9, 17, 36, 37])[:, None], torch.arange(L)[None]
        out = (j >= lens) | (j < lens - 6) if masked == "window" else j >= lens
        bias = torch.zeros(S, L).masked_fill_(out, -torch.inf)
        want = reference_attention(q, k, v, bias, 0.125)
        cache_k[:S, :, :L][bias.isinf()[:, None, :].expand(S, kv, L)] = torch.nan
        cache_v[:S, :, :L][bias.isinf()[:, None, :].expand(S, kv, L)] = torch.nan
    else:
        want = reference_attention(q, k, v, bias, 0.125)
    torch.testing.assert_close(lab.decode_attention(q, k, v, bias, 0.125), want)


@needs_lab
def test_a_zero_bias_reads_as_none_and_far_scores_weigh_nothing():
    """A bias of zeros (the tail mask of a batch whose sequences are all as long) gives the very bits of no bias;
    keys scored far below the best (exp arguments down to -400, past -104 where the softmax's exp gives 0) weigh
    nothing and the rest weigh as in fp64 within a few ulp (scores exact: -l / 2 for keys l < 20, -200 - l past them;
    value l the l-th unit vector, so the output is the weights)."""
    g = torch.Generator().manual_seed(7)
    S, KV, H, L, D = 3, 2, 6, 41, 64
    q, k, v = (torch.randn(S, n, *rest, D, generator=g) for n, rest in ((H, ()), (KV, (L,)), (KV, (L,))))
    assert torch.equal(lab.decode_attention(q, k, v, torch.zeros(S, L), 0.125),
                       lab.decode_attention(q, k, v, None, 0.125))
    q, k, v = torch.zeros(S, H, D), torch.zeros(S, KV, L, D), torch.eye(L, D).expand(S, KV, L, D)
    j = torch.arange(L, dtype=torch.float32)
    q[..., 0], k[..., 0] = 1.0, torch.where(j < 20, -j / 2, -200 - j)
    weights = lab.decode_attention(q, k, v, None, 1.0)[..., :L]  # value l is the l-th unit vector
    want = torch.softmax(torch.where(j < 20, -j / 2, -200 - j).double(), 0)
    assert (weights[..., 20:] == 0).all()
    assert ((weights[..., :20] - want[:20]).abs() / want[:20]).max() < 4e-7  # a few ulp


@needs_lab
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (6, 2, 20)])
def test_rotary_decode_attention_is_rotary_then_writes_then_decode_attention(dtype, heads, kv, d):
    """The fused decode (each group rotates its rows and writes its K and V, then attends) gives the bits of
    rotary_, write_rows_ and decode_attention one after another: the same output and cache, qkv left as it was;
    ragged positions (a bias), more seats than decodes, strided rows; a row outside its own seat and head (where
    another group reads) is refused."""
    g = torch.Generator().manual_seed(heads + d)
    S, seats, cap = 5, 7, 40
    qkv = torch.randn(S, (heads + 2 * kv) * d + 3, generator=g)[:, 3:]  # strided rows, as the product's views
    qk, v = qkv[:, :(heads + kv) * d].view(S, heads + kv, d), qkv[:, (heads + kv) * d:].view(S, kv, d)
    cos, sin = torch.randn(S, d, generator=g), torch.randn(S, d, generator=g)
    pos = torch.tensor([3, 11, 0, 25, 17])
    length = int(pos.max()) + 1
    rows = ((torch.arange(S)[:, None] * kv + torch.arange(kv)[None]) * cap + pos[:, None]).reshape(-1)
    bias = torch.zeros(S, length).masked_fill_(torch.arange(length)[None] > pos[:, None], -torch.inf)
    caches = [torch.randn(seats, kv, cap, d, generator=g).to(dtype) for _ in range(2)]
    k1, v1 = (c.clone() for c in caches)
    x = qk.clone()
    lab.rotary_(x, cos, sin)
    lab.write_rows_(k1.view(-1, d), rows, x[:, heads:])
    lab.write_rows_(v1.view(-1, d), rows, v)
    want = lab.decode_attention(x[:, :heads], k1[:S, :, :length], v1[:S, :, :length], bias, 0.125)
    before = qkv.clone()
    k2, v2 = (c.clone() for c in caches)
    got = lab.rotary_decode_attention(qkv, cos, sin, k2, v2, rows, bias, length, heads, 0.125)
    assert torch.equal(got, want) and torch.equal(k2, k1) and torch.equal(v2, v1) and torch.equal(qkv, before)
    assert not torch.equal(k2, caches[0])  # the writes happened
    for wrong in (rows + seats * kv * cap, rows.roll(1)):  # beyond the cache; in another group's seat or head
        with pytest.raises(RuntimeError, match="outside its own seat"):
            lab.rotary_decode_attention(qkv, cos, sin, k2, v2, wrong, bias, length, heads, 0.125)


def each_token_alone(q, k, v, spans, scale):
    """Reference: token t's query heads against keys [first, end) of its sequence, k and v [S, KV, L, D]."""
    return torch.cat([reference_attention(q[t:t + 1], k[s:s + 1, :, a:b], v[s:s + 1, :, a:b], None, scale)
                      for t, (s, a, b) in enumerate(spans.tolist())])


def unread_poisoned(cache, spans):
    """NaN in every key and value of `cache` [S, KV, L, D] that no span covers."""
    covered = torch.zeros(cache.shape[0], cache.shape[2], dtype=torch.bool)
    for s, a, b in spans.tolist():
        covered[s, a:b] = True
    cache.masked_fill_(~covered[:, None, :, None], torch.nan)


@needs_lab
@pytest.mark.parametrize("heads,kv,d", [(9, 3, 64), (14, 2, 64), (6, 2, 20)])
def test_token_attention_reads_each_tokens_own_keys_in_a_slot_cache(heads, kv, d):
    """Ragged prompts, a chunk after a cached prefix, a sliding window's span and lone decodes in scattered seats,
    in one call; q a strided view as the fused projection gives it; keys no span covers hold NaN, never read."""
    g = torch.Generator().manual_seed(heads + d)
    S, cap = 6, 40
    k, v = torch.randn(S, kv, cap, d, generator=g), torch.randn(S, kv, cap, d, generator=g)
    spans = [(4, 0, p + 1) for p in range(7)]            # a whole prompt of 7 in seat 4
    spans += [(1, 0, p + 1) for p in range(20, 33)]      # a chunk of 13 after a 20-token prefix in seat 1
    spans += [(0, max(0, p - 5), p + 1) for p in range(9, 12)]  # a window of 6 keys in seat 0
    spans += [(5, 0, 39), (2, 0, 1)]                     # decodes
    spans = torch.tensor(spans)
    q = torch.randn(len(spans), heads + 2 * kv, d, generator=g)[:, :heads]
    want = each_token_alone(q, k, v, spans, 0.125)
    unread_poisoned(k, spans)
    unread_poisoned(v, spans)
    torch.testing.assert_close(lab.token_attention(q, k, v, spans, None, 0.125), want)


@needs_lab
def test_token_attention_reads_a_paged_cache_through_its_rows():
    """Through each sequence's block rows (blocks in no order): the same as attention over the gathered keys; rows
    no span covers hold NaN, unread."""
    from engine.model.kv_cache import PagedCache

    g = torch.Generator().manual_seed(0)
    cache = PagedCache(1, 12, 4, 2, 16)
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g))
    rows = cache.keys(torch.tensor([[3, 7, 1], [10, 0, 5]]))  # 12 positions each
    spans = torch.tensor([(1, 0, 9), (1, 0, 10), (0, 0, 12), (0, 2, 5)])
    k, v = cache.gather(0, rows)
    q = torch.randn(4, 6, 16, generator=g)
    want = each_token_alone(q, k, v, spans, 0.25)
    unread_poisoned(k, spans)
    unread_poisoned(v, spans)
    for store, keys in ((cache.k[0], k), (cache.v[0], v)):  # blocks in no table, and unread rows, all NaN
        store.fill_(torch.nan).view(-1, 16)[rows.view(-1)] = keys.reshape(-1, 16)
    torch.testing.assert_close(lab.token_attention(q, cache.k[0], cache.v[0], spans, rows, 0.25), want)


@needs_lab
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
def test_library_is_built_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    flags = [f if f != "-O3" else "-O0" for f in native._flags()]  # unoptimised: the cache is under test, not the code
    lib = native._build(flags)
    assert lib.parent == tmp_path / "native" and lib.stat().st_size > 0
    assert list(lib.parent.iterdir()) == [lib]  # nothing half-written left beside it

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again although cached")

    monkeypatch.setattr(subprocess, "run", no_compiling)
    monkeypatch.setattr(subprocess, "Popen", no_compiling)
    assert native._build(flags) == lib


POLICIES = [{"name": "continuous", "max_running": 3}, {"name": "chunked", "max_running": 3, "token_budget": 16}]


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
    net = FlatModel(tiny_llama)
    assert net.ops is None
    got, want = scenario_tokens(tiny_llama, net, [POLICIES[0]])
    assert got == want


@needs_lab
@pytest.mark.parametrize("fused", [True, False])
def test_both_paths_give_generates_tokens(tiny, fused):
    name, model = tiny
    net = FlatModel(model, native_kernels=fused)
    assert (net.ops is not None) == fused
    got, want = scenario_tokens(model, net, POLICIES)
    assert got == want, name
