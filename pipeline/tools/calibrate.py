"""python -m pipeline.tools.calibrate [--write]: every GPU's efficiency terms solved on the published runs its
conf/hardware file names (`efficiency.calibrated_from`), printed; --write puts them into the files. Run it after
adding a GPU or a calibration run; the terms are then held fixed (reports/gpu_validation.md counts no calibration run).
"""
import re
import sys

from pipeline.config import CONF
from pipeline.modeling.gpu_validation import calibrate


def write(gpu: str, terms: dict) -> None:
    path = CONF / "hardware" / f"{gpu}.yaml"
    text = path.read_text()
    for term, value in terms.items():  # the value in place, its comment kept
        text, n = re.subn(rf"^(  {term}: *)[0-9.e-]+", lambda m: f"{m.group(1)}{value:g}", text, count=1,
                          flags=re.M)
        if not n:
            raise SystemExit(f"calibrate: {path} has no `efficiency.{term}` line to set")
    path.write_text(text)


if __name__ == "__main__":
    got = calibrate()
    for gpu, terms in got.items():
        print(f"{gpu:<10} " + "  ".join(f"{k} {v:g}" for k, v in terms.items()))
        if "--write" in sys.argv[1:]:
            write(gpu, terms)
