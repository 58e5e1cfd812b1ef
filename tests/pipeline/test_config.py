"""Config composes for every option of every group; a bad option fails at composition and lists the valid ones."""
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from omegaconf import OmegaConf

from pipeline.config import compose_config, precision_spec
from pipeline.params import PARAMS
from pipeline.workloads.runs import point_overrides, runs

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUPS = [d.name for d in CONF.iterdir() if d.is_dir() and d.name != "experiment"]


@pytest.mark.parametrize("group, option", [(g, f.stem) for g in GROUPS for f in sorted((CONF / g).glob("*.yaml"))])
def test_every_option_composes(group, option):
    """The option chosen is the option composed: every value its file holds (over the options of its group it names
    first), nothing else, nothing overridden."""
    cfg = compose_config([f"{group}={option}"])
    own = OmegaConf.load(CONF / group / f"{option}.yaml")
    bases = [OmegaConf.load(CONF / group / f"{d}.yaml") for d in own.pop("defaults", []) if d != "_self_"]
    want = OmegaConf.to_container(OmegaConf.merge(*bases, own), resolve=True)
    assert OmegaConf.to_container(cfg[group], resolve=True) == want


@pytest.mark.parametrize("experiment", [f.stem for f in sorted((CONF / "experiment").glob("*.yaml"))])
def test_every_experiment_and_its_runs_compose(experiment):
    base = compose_config([])
    table = compose_config([f"+experiment={experiment}"]).table
    assert table.name == experiment
    composed = runs(base, experiment)
    points = point_overrides(table)
    assert len(composed) == len(points) >= 1
    for _, cfg in composed:
        assert cfg.policy.name and cfg.workload.name and cfg.load.process


def hydra_compose(overrides: list[str]):
    """Hydra's own composition, every time from the files."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


@pytest.mark.parametrize("overrides", [
    ["model=llama-3.1-8b-shape", "precision=bf16-cuda", "hardware=h100-sxm", "slo=chat", "max_request_tokens=8192"],
    ["seed=3", "policy=chunked", "policy.token_budget=16", "workload=azure-conv", "load=bursty", "load.burstiness=.5"],
    ["+experiment=all_policies", "policy=dynamic", "policy.max_wait_ms=5"],  # a table's file, then its point
    ["policy.max_running=4", "policy=continuous", "+extra.knob=1", "~computed.dgx-spark"],  # values after choices
    ["tables=[main,kv_memory]", "bench.server.runs=[{name:a,server:engine}]", "++seed=7"],
])
def test_a_composition_is_what_hydra_composes(overrides):
    """compose_config composes each set of group choices once and applies the value overrides to a copy: the
    result is Hydra's, twice in a row (the cached choices untouched by the first caller's changes)."""
    compose_config(overrides).seed = -1  # a caller changes its copy
    ours = compose_config(overrides)
    assert OmegaConf.to_yaml(ours) == OmegaConf.to_yaml(hydra_compose(overrides)) and OmegaConf.is_struct(ours)


@pytest.mark.parametrize("bad", [["policy.nope=1"], ["~computed.nope"], ["experiment=all_policies"], ["+seed=1"]])
def test_a_bad_override_fails_as_hydra_fails(bad):
    with pytest.raises(Exception) as ours:
        compose_config(bad)
    with pytest.raises(Exception) as theirs:
        hydra_compose(bad)
    assert (type(ours.value), str(ours.value)) == (type(theirs.value), str(theirs.value))


def test_bad_option_lists_the_valid_ones():
    with pytest.raises(MissingConfigException) as err:
        compose_config(["policy=fastest"])
    assert "Available options" in str(err.value) and "chunked" in str(err.value)


def test_a_level_the_model_cannot_run_fails_at_composition():
    with pytest.raises(ValueError) as err:
        compose_config(["precision=w4", "model=tiny-chat"])
    assert "smollm2-135m" in str(err.value) and "fp32" in str(err.value) and "w4" not in str(err.value).split(":")[-1]
    assert compose_config(["precision=w4"]).model.source == "gguf"  # the default model has its GGUF file
    for level in ("w4a8", "w8a8"):  # the 8-bit levels read the same file
        with pytest.raises(ValueError, match="smollm2-135m"):
            compose_config([f"precision={level}", "model=tiny-chat"])
    w8a8 = precision_spec(compose_config(["precision=w8a8"]).precision)
    assert (w8a8.activations, w8a8.requantize, w8a8.lossy) == ("int8", "q8_0", True)


def test_an_edited_params_yaml_fails_the_same_way(tmp_path, monkeypatch):
    """`dvc exp run -S model=tiny-chat` on params.yaml at w4: the stage's load refuses it before any work."""
    from pipeline import params

    cfg = OmegaConf.load(PARAMS)
    cfg.model, cfg.precision = compose_config(["model=tiny-chat"]).model, compose_config(["precision=w4"]).precision
    OmegaConf.save(cfg, tmp_path / "params.yaml")
    monkeypatch.setattr(params, "PARAMS", tmp_path / "params.yaml")
    with pytest.raises(ValueError, match="model tiny-chat has none"):
        params.load([])
    monkeypatch.setattr(params, "PARAMS", PARAMS)
    assert params.load([]).precision.name == OmegaConf.load(PARAMS).precision.name  # the committed one loads


@pytest.mark.parametrize("key, value, said", [
    ("threads", "two", "threads is text ('two'), where conf/ gives a whole number (2)"),
    ("policy.max_running", 8.5, "policy.max_running is a number (8.5), where conf/ gives a whole number"),
    ("server.port", [8000], "server.port is a list ([8000]), where conf/ gives a whole number"),
    ("measure", 3, "measure is a whole number (3), where conf/ gives a section"),
    ("server.read_timeout_s", None, "lacks server.read_timeout_s, which conf/ gives (20)"),
], ids=["text-for-int", "float-for-int", "list-for-int", "int-for-section", "missing"])
def test_a_params_yaml_value_of_the_wrong_kind_fails_naming_its_key(tmp_path, monkeypatch, key, value, said):
    from pipeline import params

    cfg = OmegaConf.load(PARAMS)
    if value is None:
        del cfg.server[key.split(".")[1]]
    else:
        OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.save(cfg, tmp_path / "params.yaml")
    monkeypatch.setattr(params, "PARAMS", tmp_path / "params.yaml")
    with pytest.raises(ValueError, match="compose it again") as err:
        params.load([])
    assert f"params.yaml {said}" in str(err.value)


def test_params_yaml_is_the_composed_default():
    assert OmegaConf.to_container(OmegaConf.load(PARAMS)) == OmegaConf.to_container(compose_config([]))


def test_speculation_is_checked_at_composition_and_built_from_its_group(tmp_path):
    """A request-level policy or a bad field fails composing; ngram builds prompt lookup, draft loads its model by
    name, adaptive reads the fitted cost model and names the stage that writes it when it is missing."""
    from engine.core.speculation import NgramDrafter
    from engine.model.draft import DraftModel
    from pipeline.config import speculation

    with pytest.raises(ValueError, match="cannot speculate"):
        compose_config(["speculative=ngram", "policy=dynamic"])
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        compose_config(["speculative=ngram", "speculative.prompt_lookup_max=1"])
    assert speculation(compose_config([]), 512) is None
    spec = speculation(compose_config(["speculative=ngram", "speculative.num_speculative_tokens=3"]), 512)
    assert isinstance(spec.drafter, NgramDrafter) and spec.k_max == 3 and not spec.adaptive
    draft = speculation(compose_config(["speculative=draft", "speculative.draft_model=tiny-llama"]), 512)
    assert isinstance(draft.drafter, DraftModel)
    with pytest.raises(ValueError, match="49152 ids"):
        speculation(compose_config(["speculative=draft", "speculative.draft_model=tiny-llama"]), 49152)
    with pytest.raises(ValueError, match="dvc repro fit_cost_model"):
        speculation(compose_config(["speculative=ngram", "speculative.adaptive=true",
                                    f"speculative.cost_model={tmp_path}/none.json"]), 512)
    (tmp_path / "cost.json").write_text('{"cost_model": {"fixed": 0.01, "coef": {"num_decode_rows": 0.001}}}')
    spec = speculation(compose_config(["speculative=ngram", "speculative.adaptive=true",
                                       f"speculative.cost_model={tmp_path}/cost.json"]), 512)
    assert spec.adaptive and spec.cost.coef == {"num_decode_rows": 0.001}
