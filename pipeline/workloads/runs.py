"""A table's runs: its experiment file's `points` (override sets) crossed with its `sweep` axes, each composed."""
import itertools

from omegaconf import DictConfig

from engine.config import compose_config


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


def runs(base: DictConfig, table: str) -> list[tuple[str, DictConfig]]:
    """(label, config) for every run of a table."""
    spec = base.table if table == "main" else table_config(base, table).table
    if table == "main":
        return [("main", base)]
    return [(label(o), table_config(base, table, o)) for o in point_overrides(spec)]
