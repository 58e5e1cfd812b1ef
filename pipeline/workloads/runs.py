"""A table's runs: its experiment file's `points` (override sets) crossed with its `sweep` axes, each composed. A
point may set `precision`: a level this model or device cannot run is left out, said (the table's other points run)."""
import itertools

from omegaconf import DictConfig

from pipeline.config import compose_config


def point_overrides(table) -> list[dict]:
    """Every run of a table as a dict of Hydra overrides: for each sweep value, every point, in order."""
    axes = dict(table.get("sweep") or {})
    grid = [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] if axes else [{}]
    return [{**dict(p), **g} for g in grid for p in (table.get("points") or [{}])]


def label(overrides: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in overrides.items()) or "default"


def table_config(base: DictConfig, table: str, overrides: dict | None = None) -> DictConfig:
    """The config of one run: the base's model, precision, profile, slo, seed, threads and max_request_tokens, the
    table's experiment file, then the run's own overrides. The table "main" is the base config itself."""
    if table == "main":
        return base
    top = [f"{g}={base[g].name}" for g in ("model", "precision", "profile", "slo")]
    top += [f"seed={base.seed}", f"threads={base.threads}", f"max_request_tokens={base.max_request_tokens}",
            f"+experiment={table}"]
    return compose_config(top + [f"{k}={v}" for k, v in (overrides or {}).items()])


def level_not_here(base: DictConfig, name: str) -> str | None:
    """Why precision level `name` cannot run beside the base config's (its model has no GGUF file for it, or the
    level runs on another device than the configured one); None when it can."""
    try:
        level = compose_config([f"model={base.model.name}", f"precision={name}"]).precision
    except ValueError as exc:
        return str(exc)
    if level.device != base.precision.device:
        return f"precision {name} runs on {level.device}, the configured level on {base.precision.device}"
    return None


def runs(base: DictConfig, table: str) -> list[tuple[str, DictConfig]]:
    """(label, config) for every run of a table. Points at a precision level that cannot run here are left out; if
    that leaves none, the table's points run at the configured level instead."""
    if table == "main":
        return [("main", base)]
    points = point_overrides(table_config(base, table).table)
    levels = {str(o["precision"]) for o in points if "precision" in o}
    missing = {name: level_not_here(base, name) for name in sorted(levels)}  # level -> why it cannot run here
    out = []
    for o in points:
        why = missing.get(str(o.get("precision")))
        if why:
            print(f"{table} | {label(o)}: not run here: {why}", flush=True)
            continue
        out.append((label(o), o))
    if not out:  # no level of the table runs here: its points at the configured level, each once
        kept = {label(p): p for p in ({k: v for k, v in o.items() if k != "precision"} for o in points)}
        out = list(kept.items())
    return [(name, table_config(base, table, o)) for name, o in out]

