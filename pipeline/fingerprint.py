"""Stage fingerprint: this machine's fingerprint to reports/machine.json, on every `dvc repro` (always_changed).

Every stage that measures depends on that file, so a new CPU, GPU, thread count or library version reruns them,
and the same machine leaves them as they are.
"""
from pipeline.config import ROOT, load
from pipeline.env import environment
from pipeline.io import write_json

MACHINE = ROOT / "reports" / "machine.json"


def main(cfg) -> dict:
    fp = environment(int(cfg.threads), cfg.precision.device)
    write_json(MACHINE, fp)
    print(f"machine {fp['id']}: {fp['label']}")
    return fp


if __name__ == "__main__":
    main(load())
