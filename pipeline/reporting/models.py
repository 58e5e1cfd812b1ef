"""REPORT.md's model section: this run's headline figures beside those of each other model run on this machine
(reports/models/<model>/metrics.json, kept there from a `dvc exp run -S model=...` by pipeline.tools.keep_reports),
so a reader sees how batching's gains change with the model."""
import json
from pathlib import Path

from pipeline.reporting.tables import fmt, markdown

HEADER = ["model", "static tok/s", "continuous tok/s", "chunked-128 tok/s", "continuous / static",
          "TTFT p99 continuous, s", "TTFT p99 chunked-128, s", "fp32 decode B=1 tok/s", "w4 / fp32 decode B=1",
          "w4 / fp32 decode B=64", "w4 KLD", "engine server c=64 tok/s"]


def _decode(metrics: dict, level: str, batch: int) -> float | None:
    """engine_speed's decode rate (tok/s) at `level` and B = batch, whatever its prompt length."""
    prefix = f"engine_speed.{level}.b{batch}_p"
    return next((v for k, v in metrics.items() if k.startswith(prefix) and k.endswith(".engine_decode_tps")), None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def row(model: str, m: dict) -> list:
    tps = {p: m.get(f"all_policies.{p}.throughput_tps") for p in ("static", "continuous", "chunked-128")}
    return [model, fmt(tps["static"], 1), fmt(tps["continuous"], 1), fmt(tps["chunked-128"], 1),
            fmt(_ratio(tps["continuous"], tps["static"])), fmt(m.get("all_policies.continuous.ttft_p99_s")),
            fmt(m.get("all_policies.chunked-128.ttft_p99_s")), fmt(_decode(m, "fp32", 1), 1),
            fmt(_ratio(_decode(m, "w4", 1), _decode(m, "fp32", 1))),
            fmt(_ratio(_decode(m, "w4", 64), _decode(m, "fp32", 64))),
            "n/a" if m.get("precision.w4.kld_mean") is None else f"{m['precision.w4.kld_mean']:.2e}",
            fmt(m.get("server.engine-continuous.c64.throughput_tps"), 1)]


def others(reports: Path, machine: dict) -> list[tuple[str, dict, str]]:
    """(model, metrics, note) of each model kept under reports/models/, its note naming another machine if it ran
    on one."""
    kept = []
    for folder in sorted((reports / "models").glob("*/")):
        if not (folder / "metrics.json").exists():
            continue
        theirs = json.loads((folder / "machine.json").read_text())
        note = "" if theirs["id"] == machine["id"] else f" (measured on another machine: {theirs['label']})"
        kept.append((folder.name, json.loads((folder / "metrics.json").read_text()), note))
    return kept


def render(model: str, metrics: dict, reports: Path, machine: dict) -> str | None:
    """The section's table, this run's model first; None when no other model is kept."""
    kept = others(reports, machine)
    if not kept:
        return None
    rows = [row(f"{model} (this run)", metrics)] + [row(name + note, m) for name, m, note in kept]
    return markdown(HEADER, rows)
