"""The report never mixes machines: a results file measured elsewhere stops it with an error naming both machines,
unless the config labels that file as another machine's on purpose."""
import json

import pytest

from pipeline.config import compose_config
from pipeline.measuring.fingerprint import environment
from pipeline.reporting import report


@pytest.fixture()
def repo(tmp_path):
    """An empty repository layout with this machine's fingerprint."""
    (tmp_path / "reports").mkdir()
    here = environment(2)
    (tmp_path / "reports" / "machine.json").write_text(json.dumps(here))
    other = {**here, "id": "0123456789ab", "label": "Intel(R) Xeon(R) Platinum (AVX-512), 2 threads, torch 2.13.0"}
    return tmp_path, here, other


def equivalence(machine: dict) -> dict:
    return {"model": "m", "dtype": "float32", "matches": {"continuous": 6}, "requests": 6, "machine": machine}


def test_report_refuses_figures_of_another_machine(repo):
    root, here, other = repo
    (root / "reports" / "equivalence.json").write_text(json.dumps(equivalence(other)))
    with pytest.raises(report.MixedMachines) as err:
        report.build(compose_config([]), root)
    msg = str(err.value)
    assert "reports/equivalence.json" in msg and other["label"] in msg and here["label"] in msg


def test_report_labels_another_machines_file_when_told(repo):
    root, here, other = repo
    (root / "reports" / "equivalence.json").write_text(json.dumps(equivalence(other)))
    text, _ = report.build(compose_config(["report.other_machine=[reports/equivalence.json]"]), root)
    assert here["label"] in text and f"Measured on another machine: {other['label']}" in text


def test_report_of_one_machine_names_it(repo):
    root, here, _ = repo
    (root / "reports" / "equivalence.json").write_text(json.dumps(equivalence(here)))
    text, _ = report.build(compose_config([]), root)
    assert here["label"] in text and "another machine" not in text and "| continuous | 6/6 |" in text


def test_an_experiments_reports_are_kept_beside_the_main_ones(tmp_path):
    """keep_reports (make gpu-check, a model experiment): the newest experiment of that name has its reports copied
    under reports/machines/<its fingerprint id>/ (another machine) or reports/models/<its model>/ (this machine,
    another model), only the files it wrote; the main reports stay as they are; one that repeats the main run is
    refused."""
    import subprocess

    from pipeline.tools import keep_reports

    def git(*args):
        subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@localhost", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    def run(name, machine, model, text):
        (reports / "machine.json").write_text(json.dumps({"id": machine, "label": machine}))
        (tmp_path / "params.yaml").write_text(f"model:\n  name: {model}\n")
        (reports / "REPORT.md").write_text(text)
        (reports / "plots" / "x.png").write_bytes(text.encode())
        git("add", "-A")
        git("commit", "-qm", name)
        if name != "main":
            git("update-ref", f"refs/exps/ab/cdef/{name}", "HEAD")
            git("reset", "-q", "--hard", "HEAD~1")

    reports = tmp_path / "reports"
    (reports / "plots").mkdir(parents=True)
    git("init", "-q")
    (reports / "PEER.md").write_text("measured elsewhere\n")
    run("main", "cpu0", "small", "cpu report\n")
    run("gpu-1", "gpu0", "big", "gpu report\n")
    run("second", "cpu0", "other", "other model\n")
    run("again", "cpu0", "small", "the same run\n")
    assert keep_reports.keep("gpu-1", tmp_path) == reports / "machines" / "gpu0"
    assert keep_reports.keep("second", tmp_path) == reports / "models" / "other"
    for kept, text in ((reports / "machines" / "gpu0", "gpu report\n"),
                       (reports / "models" / "other", "other model\n")):
        assert (kept / "REPORT.md").read_text() == text and (kept / "plots" / "x.png").read_bytes() == text.encode()
    assert not (reports / "models" / "other" / "PEER.md").exists()  # carried from the baseline, not written by it
    assert json.loads((reports / "models" / "other" / "machine.json").read_text())["id"] == "cpu0"  # always kept
    assert (reports / "REPORT.md").read_text() == "cpu report\n"
    with pytest.raises(SystemExit, match="this machine and this model"):
        keep_reports.keep("again", tmp_path)
    with pytest.raises(SystemExit, match="no DVC experiment named 'gpu-2'"):
        keep_reports.keep("gpu-2", tmp_path)


def test_other_models_appear_beside_this_run(tmp_path):
    """REPORT.md's model section: each model kept under reports/models/ gets a row beside this run's, its ratios
    computed from its own metrics, another machine's named; no section without one."""
    from pipeline.reporting import models

    here = {"id": "m0", "label": "this CPU"}
    assert models.render("small", {}, tmp_path, here) is None
    ours = {"all_policies.static.throughput_tps": 50.0, "all_policies.continuous.throughput_tps": 150.0,
            "engine_speed.fp32.b1_p38.engine_decode_tps": 40.0, "engine_speed.w4.b1_p38.engine_decode_tps": 100.0}
    theirs = {"all_policies.static.throughput_tps": 20.0, "all_policies.continuous.throughput_tps": 30.0,
              "engine_speed.fp32.b1_p41.engine_decode_tps": 10.0, "engine_speed.w4.b1_p41.engine_decode_tps": 35.0,
              "precision.w4.kld_mean": 0.0012}
    for name, machine in (("big", here), ("far", {"id": "m1", "label": "a GPU"})):
        (tmp_path / "models" / name).mkdir(parents=True)
        (tmp_path / "models" / name / "metrics.json").write_text(json.dumps(theirs))
        (tmp_path / "models" / name / "machine.json").write_text(json.dumps(machine))
    lines = models.render("small", ours, tmp_path, here).splitlines()
    assert lines[2].startswith("| small (this run) | 50.0 | 150.0 | n/a | 3.00 |") and "| 2.50 |" in lines[2]
    assert lines[3].startswith("| big | 20.0 | 30.0 | n/a | 1.50 |") and "| 3.50 | n/a | 1.20e-03 |" in lines[3]
    assert lines[4].startswith("| far (measured on another machine: a GPU) |")
