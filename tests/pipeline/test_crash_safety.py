"""A stage's results land whole and together, or not at all: killed with SIGKILL between two of its writes, a stage
leaves its previous files as they were; a file with no room on its filesystem (a real tiny one where this machine
lets a user mount one) fails naming the bytes it needed, and the previous file stays byte for byte."""
import errno
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

from pipeline import results
from pipeline.results import DiskFull, owns, together, write_json, write_parquet, write_text

ROOT = Path(__file__).resolve().parents[2]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)


def test_a_stage_killed_between_two_writes_leaves_its_previous_files(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.md"
    write_json(a, {"run": 1})
    write_text(b, "run 1\n")
    killed = run(f"""
        import os, signal
        from pipeline.results import together, write_json, write_text
        with together():
            write_json({str(a)!r}, {{"run": 2}})
            os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, between the stage's two writes
            write_text({str(b)!r}, "run 2\\n")
    """)
    assert killed.returncode == -9, killed.stderr
    assert a.read_text() == '{\n  "run": 1\n}\n' and b.read_text() == "run 1\n"  # never a mix of runs
    assert len(list(tmp_path.glob(".a.json.*.tmp"))) == 1  # the killed writer's temporary file...
    write_json(a, {"run": 3})
    assert not list(tmp_path.glob(".*.tmp"))  # ...is removed by the next write, its writer being gone
    with together():
        write_json(a, {"run": 4})
        write_text(b, "run 4\n")
        assert a.read_text() != '{\n  "run": 4\n}\n'  # held until the block ends
    assert json.loads(a.read_text()) == {"run": 4} and b.read_text() == "run 4\n"


def test_a_block_that_fails_lands_nothing_and_a_folder_output_keeps_this_runs_files_only(tmp_path):
    plots = tmp_path / "plots"
    write_text(plots / "old.png", "a plot no run draws any more")
    write_text(plots / "kept.csv", "1")
    with pytest.raises(ValueError), together():
        write_text(plots / "kept.csv", "2")
        raise ValueError("the stage failed")
    assert (plots / "kept.csv").read_text() == "1" and not list(plots.glob(".*.tmp"))
    with together():
        owns(plots)
        write_text(plots / "kept.csv", "3")
    assert sorted(p.name for p in plots.iterdir()) == ["kept.csv"]


def test_a_write_with_no_room_names_the_bytes_and_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "rows.parquet"
    write_parquet(path, pd.DataFrame({"x": [1, 2]}))
    before = path.read_bytes()
    real = shutil.disk_usage
    monkeypatch.setattr(results.shutil, "disk_usage", lambda p: real(p)._replace(free=100))
    with pytest.raises(DiskFull, match=r"no room to write .*rows\.parquet: \d+ bytes needed, 100 free"):
        write_parquet(path, pd.DataFrame({"x": range(1000)}))
    monkeypatch.setattr(results.shutil, "disk_usage", real)

    def full(fd, *a, **k):  # the filesystem fills while the file is written
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(results.os, "fdopen", full)
    with pytest.raises(DiskFull, match="bytes needed"):
        write_parquet(path, pd.DataFrame({"x": range(1000)}))
    assert path.read_bytes() == before and not list(tmp_path.glob(".*.tmp"))


def test_a_real_tiny_filesystem_that_fills(tmp_path):
    """A 64 KiB tmpfs in a user and mount namespace of its own (unshare -rm): a result that does not fit is refused
    before it is written, one that the filesystem runs out of room for while it is written (its free space misread)
    fails there; both with the message, the previous file byte for byte, no temporary file left; one that fits is
    written."""
    if not shutil.which("unshare") or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode:
        pytest.skip("this machine does not let a user mount a filesystem (unshare -rm)")
    mount = tmp_path / "tiny"
    mount.mkdir()
    script = tmp_path / "fill.py"
    script.write_text(textwrap.dedent(f"""
        import os, shutil
        from pipeline import results
        from pipeline.results import DiskFull, write_bytes
        path = {str(mount / "result.json")!r}
        write_bytes(path, b"previous" * 1000)
        for misread in (False, True):
            if misread:
                results.shutil.disk_usage = lambda p: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40)
            try:
                write_bytes(path, b"x" * 100_000)
            except DiskFull as exc:
                print("refused:", exc)
            assert open(path, "rb").read() == b"previous" * 1000 and os.listdir({str(mount)!r}) == ["result.json"]
        write_bytes(path, b"new" * 1000)
        print("then:", open(path, "rb").read()[:3].decode())
    """))
    out = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mount} && "
                          f"{sys.executable} {script}"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("refused: no room to write") == 2 and "100000 bytes needed" in out.stdout, out.stdout
    assert "then: new" in out.stdout
