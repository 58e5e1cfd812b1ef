"""The report never mixes machines: a results file measured elsewhere stops it with an error naming both machines,
unless the config labels that file as another machine's on purpose."""
import json

import pytest

from engine.config import compose_config
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
    """machine_reports (make gpu-check): the newest experiment of that name has its reports copied under
    reports/machines/<its fingerprint id>/; the main reports stay as they are."""
    import subprocess

    from pipeline.tools import machine_reports

    def git(*args):
        subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@localhost", *args], cwd=tmp_path,
                       check=True, capture_output=True)

    reports = tmp_path / "reports"
    (reports / "plots").mkdir(parents=True)
    git("init", "-q")
    (reports / "machine.json").write_text(json.dumps({"id": "cpu0", "label": "a CPU"}))
    (reports / "REPORT.md").write_text("cpu report\n")
    git("add", "-A")
    git("commit", "-qm", "cpu")
    (reports / "machine.json").write_text(json.dumps({"id": "gpu0", "label": "a GPU"}))
    (reports / "REPORT.md").write_text("gpu report\n")
    (reports / "plots" / "x.png").write_bytes(b"\x89PNG")
    git("add", "-A")
    git("commit", "-qm", "gpu")
    git("update-ref", "refs/exps/ab/cdef/gpu-1", "HEAD")
    git("reset", "-q", "--hard", "HEAD~1")
    machine_reports.keep("gpu-1", tmp_path)
    kept = reports / "machines" / "gpu0"
    assert (kept / "REPORT.md").read_text() == "gpu report\n" and (kept / "plots" / "x.png").read_bytes() == b"\x89PNG"
    assert (reports / "REPORT.md").read_text() == "cpu report\n"
    with pytest.raises(SystemExit, match="no DVC experiment named 'gpu-2'"):
        machine_reports.keep("gpu-2", tmp_path)
