"""Command lines of the computing tools: their own key=value arguments apart from Hydra's overrides."""


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
