"""Stage fingerprint (always_changed): this machine's fingerprint to reports/machine.json, on which every measuring
stage depends, so another machine reruns them and the same one leaves them."""
from pipeline.config import ROOT
from pipeline.measuring.fingerprint import environment
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        fp = environment(int(cfg.threads), cfg.precision.device)
        write_json(ROOT / "reports" / "machine.json", fp)
        print(f"machine {fp['id']}: {fp['label']}")
