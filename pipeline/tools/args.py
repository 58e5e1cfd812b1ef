"""Command lines of the computing tools (steptime, fleet): their own key=value arguments apart from Hydra's
overrides, --help, --json, and a bad input said in one line."""
import json

from hydra.errors import HydraException


def parse_keys(argv: list[str], keys: set[str], prefixes: tuple[str, ...] = ()) -> tuple[dict, list[str], bool]:
    """(a tool's own keys: those in `keys` or starting with one of `prefixes`, Hydra overrides, --json)."""
    own, rest = {}, []
    for a in argv:
        key, _, value = a.partition("=")
        if key in keys or key.startswith(prefixes):
            own[key] = value
        elif a != "--json":
            rest.append(a)
    return own, rest, "--json" in argv


def run(tool: str, doc: str, argv: list[str], keys: set[str], compute, show, prefixes: tuple[str, ...] = ()) -> None:
    """Print compute(own keys, overrides) as show() renders it, or as one JSON object with --json; the docstring with
    --help; a SystemExit naming what is wrong otherwise."""
    if {"-h", "--help"} & set(argv):
        print(doc)
        return
    own, overrides, as_json = parse_keys(argv, keys, prefixes)
    try:
        out = compute(own, overrides)
    except (ValueError, HydraException) as exc:
        raise SystemExit(f"{tool}: {exc}") from None
    print(json.dumps(out) if as_json else show(out))
