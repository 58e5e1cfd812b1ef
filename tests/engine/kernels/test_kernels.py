"""The product each weight shape uses per row count (engine/kernels/choice.py): every choice gives generate's
tokens, the choice is measured once per machine and read back from the cache, and only the chosen layouts are held."""
import json
import os

import pytest
import torch

from engine.factory import build_net
from engine.kernels import build
from engine.kernels import choice as kernels
from engine.model.compiled import keep_inductor_cache
from engine.model.hf import generate_alone
from engine.model.layers.linear import Dense
from engine.specs import PolicySpec, PrecisionSpec
from pipeline.config import compose_config
from pipeline.measuring.equivalence import ARRIVE, LENS, run_scenario, scenario_prompts
from pipeline.measuring.hardware import kernel_table

CPU = kernels.candidates(torch.device("cpu"), torch.float32, build.ops() is not None)  # the native fp32 tiles too
POLICIES = [PolicySpec.of("continuous", 3), PolicySpec.of("chunked", 3, token_budget=16)]


@pytest.fixture(scope="module")
def references(tiny):
    name, model = tiny
    prompts = scenario_prompts(model, None)
    return name, model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.fixture(scope="module")
def llama_references(tiny_llama):
    """references() of tiny-llama alone: a custom operator inside a compiled graph is the same on each architecture."""
    prompts = scenario_prompts(tiny_llama, None)
    return "tiny-llama", tiny_llama, prompts, [generate_alone(tiny_llama, p, n) for p, n in zip(prompts, LENS)]


def run_with(net, policy, prompts):
    return run_scenario(net, policy, prompts, LENS, ARRIVE)


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
@pytest.mark.parametrize("kind", [*CPU, "per-bucket"])
def test_every_choice_gives_generates_tokens(references, kind, policy, monkeypatch):
    """Each candidate everywhere, and one differing per bucket (decode rows 1-3 and prompt chunks use different
    products in one run): the tokens of generate."""
    name, model, prompts, ref = references
    net = build_net(model, kernel=None if kind == "per-bucket" else kind)
    if kind == "per-bucket":
        for d in net.products:
            d.hold(CPU)
            d.products = [CPU[i % len(CPU)] for i in range(len(kernels.BUCKETS))]
    out = run_with(net, policy, prompts)
    assert [out[str(i)] for i in range(6)] == ref, f"{name} {kind}"


def test_choice_is_measured_once_then_cached(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)  # measure even a tiny model's shapes
    net = build_net(tiny_llama)
    cached = json.loads((tmp_path / "kernels.json").read_text())
    assert len(cached) == len(net.kernels) >= 4  # one entry per shape: qkv, o, gate-up, down, head
    for shape, c in net.kernels.items():
        assert c["choice"] == [min(c["ms"][str(r)], key=c["ms"][str(r)].get) for r in kernels.BUCKETS]
        assert set(c["ms"]["1"]) == set(CPU)

    def no_measuring(*args):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(kernels, "measure", no_measuring)
    again = build_net(tiny_llama)
    assert again.kernels == net.kernels


def test_measured_again_a_near_tie_keeps_the_earlier_choice(tiny_llama, tmp_path, monkeypatch):
    """remeasure: a cached choice within MARGIN of the new fastest stays; one beaten by more is replaced."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)
    build_net(tiny_llama, kernel=None)
    near, far = 1 + kernels.MARGIN / 2, 1 + kernels.MARGIN * 2

    def rigged(mats, device, names):  # `linear` fastest everywhere; `in_out` a near tie at 1 row, far behind elsewhere
        ms = {str(r): {"in_out": near if r == 1 else far, "linear": 1.0, "packed": far} for r in kernels.BUCKETS}
        return {"ms": ms, "choice": ["linear"] * len(kernels.BUCKETS)}

    cached = json.loads((tmp_path / "kernels.json").read_text())
    for entry in cached.values():
        entry["choice"] = ["in_out"] * len(kernels.BUCKETS)
    (tmp_path / "kernels.json").write_text(json.dumps(cached))
    monkeypatch.setattr(kernels, "measure", rigged)
    net = build_net(tiny_llama, remeasure=True)
    assert all(c["choice"] == ["in_out"] + ["linear"] * (len(kernels.BUCKETS) - 1) for c in net.kernels.values())


def test_a_candidate_is_timed_after_its_own_untimed_run_the_fastest_kept(monkeypatch):
    """A candidate whose first run after another's is slow (GGUF's whole-matrix GEMM before it frees hundreds of MB)
    and which a slow moment of the machine slows once is still measured at its own speed: its runs follow one
    untimed run of its own, the fastest kept."""
    clock, calls = [0.0], []

    class Mat:  # `fast` takes 1 ms, 20 ms on its first run after `other`'s and on its third; `other` 2 ms
        shape, dtype = (4, 4), torch.float32

        def product(self, k, x):
            calls.append(k)
            after_other = len(calls) > 1 and calls[-2] != k
            clock[0] += 2.0 if k == "other" else 20.0 if after_other or calls.count(k) == 3 else 1.0

    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0] / 1e3)
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)  # measured on purpose (tests/conftest.py)
    got = kernels.measure([Mat()], torch.device("cpu"), ("other", "fast"))
    assert got["choice"] == ["fast"] * len(kernels.BUCKETS)
    assert all(ms == pytest.approx({"other": 2.0, "fast": 1.0}) for ms in got["ms"].values())
    assert calls[:2 * (1 + kernels.REPEATS)] == ["other"] * (1 + kernels.REPEATS) + ["fast"] * (1 + kernels.REPEATS)


@pytest.mark.parametrize("damage, said", [('{"half-writ', "unreadable (JSONDecodeError"),
                                          ("[1, 2]", "are not a mapping of entries"), ("no entry", None)])
def test_a_broken_cache_is_measured_again_and_said(tiny_llama, tmp_path, monkeypatch, caplog, damage, said):
    """Cut short, not a mapping, or an entry whose choice is not one of its candidates: measured again, the file named
    in the log where it cannot be read at all, then written whole."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)
    path = tmp_path / "kernels.json"
    if damage == "no entry":
        build_net(tiny_llama)
        damage = json.dumps({k: {**v, "choice": ["gone"] * len(kernels.BUCKETS)}
                             for k, v in json.loads(path.read_text()).items()})
    path.write_text(damage)
    with caplog.at_level("WARNING", logger=kernels.__name__):
        net = build_net(tiny_llama)
    assert all(c["ms"] is not None and "gone" not in c["choice"] for c in net.kernels.values())
    assert json.loads(path.read_text()) and (said is None or f"kernel choices {path} {said}" in caplog.text)


def test_small_shapes_keep_the_default_unmeasured(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    net = build_net(tiny_llama)
    default = kernels.default(torch.device("cpu"), torch.float32)
    assert all(c == {"choice": default, "ms": None} for c in net.kernels.values())
    assert not (tmp_path / "kernels.json").exists()


def test_only_the_chosen_layouts_are_held(tiny_llama):
    linear, in_out = build_net(tiny_llama, kernel="linear"), build_net(tiny_llama, kernel="in_out")
    d, e = linear.layers[0].qkv, in_out.layers[0].qkv
    assert d.w is None and d.packed is None and d.w_out_in is not None
    assert e.w is not None and e.packed is None and e.w_out_in is None
    with pytest.raises(ValueError, match="choose from"):
        build_net(tiny_llama, kernel="cublas")


@pytest.fixture(scope="module")
def real_references(smollm2):
    model, tok = smollm2
    prompts = scenario_prompts(model, tok)
    return model, prompts, [generate_alone(model, p, n) for p, n in zip(prompts, LENS)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", CPU)
def test_real_model_every_choice(real_references, kind, monkeypatch):
    model, prompts, ref = real_references
    out = run_with(build_net(model, kernel=kind), POLICIES[0], prompts)
    assert [out[str(i)] for i in range(6)] == ref, kind


@pytest.mark.parametrize("fused", [True, False])
def test_step_split_finds_each_kind_of_operator(tiny, fused):
    """probe_hardware's split of a decode step, on the fused kernels (every layer in one call, its products counted
    apart) and on ATen's operators (matrix products, decode attention, norms and KV writes each measured, non-zero); the
    parts with the time outside operators make up the profiled step; the net keeps its kernels afterwards."""
    from pipeline.measuring.hardware import PARTS, step_split

    net = build_net(tiny[1])
    ops = net.ops
    split = step_split(net, 4, steps=3, fused=fused)
    assert net.ops is ops
    assert split["kernels"] == ("fused" if fused and ops is not None else "ATen")
    parts = split["parts"]
    layered = parts["rest of the layers call"] > 0
    assert layered == (fused and ops is not None)
    assert list(parts) == [*PARTS, "other operators", "rest of the layers call", "outside operators"]
    assert all(parts[k] > 0 for k in (["LM head", "sampler", "matrix products", "rest of the layers call"] if layered
                                      else PARTS))
    ops = sum(v for k, v in parts.items() if k != "outside operators")
    assert ops + parts["outside operators"] == pytest.approx(max(split["profiled_ms"], ops))
    assert split["step_ms"] > 0


def test_a_sustained_floor_runs_every_product_once_per_step(tiny_llama, monkeypatch):
    """engine_speed's floor: `steps` steps of every weight matrix (and the LM head) back to back per timed run,
    one warm-up run first unless not `warm`, the time given per step."""
    from pipeline.measuring.timing import step_floor_ms

    net = build_net(tiny_llama)
    calls = []
    product = Dense.product
    monkeypatch.setattr(Dense, "product",
                        lambda self, name, x, residual=None: calls.append(x.shape[0]) or product(self, name, x))
    per_step = 4 * len(net.layers) + 1
    assert step_floor_ms(net, 3, steps=5, repeats=2, warm=False) > 0
    assert calls == [3] * per_step * 5 * 2
    calls.clear()
    step_floor_ms(net, 2, steps=1, repeats=3)
    assert calls == [2] * per_step * 4


def test_the_same_cpu_limited_to_another_isa_is_another_machine(monkeypatch):
    """Kernel choices measured with AVX-512 are not reused where torch's kernels, MKL or oneDNN are limited to AVX2
    (ATEN_CPU_CAPABILITY and the like), and the key is stable otherwise."""
    cpu, f32 = torch.device("cpu"), torch.float32
    for v in kernels.ISA_LIMITS:
        monkeypatch.delenv(v, raising=False)
    base = kernels.machine_key(cpu, f32)
    assert kernels.machine_key(cpu, f32) == base
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-as-told")
    told = kernels.machine_key(cpu, f32)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert len({base, told, kernels.machine_key(cpu, f32)}) == 3


def test_a_row_count_uses_the_smallest_bucket_that_holds_it():
    rows = (1, 2, 4, 5, 16, 17, 64, 65, 256)
    assert [kernels.BUCKETS[kernels.bucket(r)] for r in rows] == [1, 4, 4, 16, 16, 64, 64, 256, 256]
    assert kernels.bucket(1000) == len(kernels.BUCKETS) - 1  # beyond the last: the last


def test_past_streamed_rows_a_share_of_the_matrices_is_timed_and_scaled_to_all(monkeypatch):
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)  # measured on purpose (tests/conftest.py)
    clock, rows_seen = [0.0], []

    class Mat:  # each product advances the clock by 1 ms
        shape, dtype = torch.Size((8, 8)), torch.float32

        def product(self, kind, x):
            clock[0] += 1e-3
            rows_seen.append(x.shape[0])

    monkeypatch.setattr(kernels.time, "perf_counter", lambda: clock[0])
    n = 8
    out = kernels.measure([Mat() for _ in range(n)], torch.device("cpu"), CPU)
    calls = len(CPU) * (kernels.REPEATS + 1)  # warm-up and repeats, every candidate
    for rows in kernels.BUCKETS:
        timed = min(n, max(1, n * kernels.STREAMED // rows))
        assert rows_seen.count(rows) == calls * timed
        assert out["ms"][str(rows)] == pytest.approx(dict.fromkeys(CPU, float(n)))  # 1 ms per matrix, all n
    assert rows_seen.count(kernels.BUCKETS[-1]) < calls * n  # the last bucket timed fewer than all


def test_a_cache_measured_with_other_candidates_is_measured_again(tiny_llama, tmp_path, monkeypatch):
    """A candidate added since the cache was written (or one that no longer runs) means the shape is measured anew."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels, "SMALL_BYTES", 0)
    build_net(tiny_llama)
    cached = json.loads((tmp_path / "kernels.json").read_text())
    for entry in cached.values():
        for ms in entry["ms"].values():
            del ms[CPU[-1]]
    (tmp_path / "kernels.json").write_text(json.dumps(cached))
    net = build_net(tiny_llama)
    assert all(set(c["ms"]["1"]) == set(CPU) for c in net.kernels.values())


@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in CPU if k in kernels.OPAQUE])
def test_compiled_steps_call_the_packed_products_whole(llama_references, kind, monkeypatch):
    """Compiled decode steps on each packed candidate this machine runs, everywhere (a custom operator inside the
    graph): generate's tokens, no graph break."""
    from torch._dynamo.utils import counters

    name, model, prompts, ref = llama_references
    net = build_net(model, kernel=kind)
    counters.clear()
    out = run_scenario(net, POLICIES[0], prompts, LENS, ARRIVE, compile=True)
    assert [out[str(i)] for i in range(6)] == ref, f"{name} {kind}"
    assert not counters["graph_break"], dict(counters["graph_break"])


def test_inductor_cache_is_kept_beside_the_kernel_choice_unless_set(tmp_path, monkeypatch):
    """Compiled steps keep Inductor's cache in LAB_CACHE_DIR/inductor instead of its default under /tmp (which
    importing torch puts in TORCHINDUCTOR_CACHE_DIR); a place the user named stays."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    keep_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    keep_inductor_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


def test_the_kernel_table_names_what_each_level_runs(tiny_llama):
    """HARDWARE.md's table: every product at every row bucket names the kernel the engine built at that level holds;
    a level the model cannot run (w4: no GGUF file) is listed with its reason, not left out."""
    cfg = compose_config(["model=tiny-llama"])
    table = kernel_table(cfg, tiny_llama)
    assert set(table["levels"]) == {"fp32", "bf16"}
    assert "model tiny-llama has none" in table["skipped"]["w4"]
    net = build_net(tiny_llama)
    fp32 = table["levels"]["fp32"]
    assert list(fp32) == ["head", "qkv", "o", "gate_up", "down"]
    for b in range(len(kernels.BUCKETS)):
        assert fp32["qkv"][b] == net.layers[0].qkv.kernel(b) in kernels.candidates(net.device, net.dtype)
    bf16 = build_net(tiny_llama, PrecisionSpec(weights="bf16"))
    assert table["levels"]["bf16"]["qkv"] == [bf16.layers[0].qkv.kernel(b) for b in range(len(kernels.BUCKETS))]
    assert all(k.startswith("bf16") for ks in table["levels"]["bf16"].values() for k in ks)


def test_pinned_kernels_run_one_kernel_at_every_row_count(tiny_llama):
    """pin_kernels(b): every product runs bucket b's kernel at any row count (check_precision's decode arithmetic)."""
    net = build_net(tiny_llama, PrecisionSpec(weights="bf16"))
    chosen = [d.products[0] for d in net.products]
    net.pin_kernels(0)
    assert [d.products for d in net.products] == [[c] * len(kernels.BUCKETS) for c in chosen]
