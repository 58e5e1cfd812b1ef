"""python -m pipeline.tools.make_stream [overrides]: the model's token stream for check_precision, continued greedily
by fp32 on this machine, written to data/streams/<model>.json (bench.precision's sequences, tokens and the seed:
`bench=full` for full's 128 sequences, of which `smoke` reads the first). Commit it: every machine then scores the
same positions."""
import json
import sys

from pipeline.config import ROOT
from pipeline.measuring.accuracy import STREAMS, reference, token_stream
from pipeline.measuring.fingerprint import environment
from pipeline.params import load
from pipeline.results import write_text

if __name__ == "__main__":
    cfg = load(sys.argv[1:])
    p = cfg.bench.precision
    _, model, tok, ref = reference(cfg)
    seqs = token_stream(ref, tok, model.config.vocab_size, int(p.sequences), int(p.tokens), int(cfg.seed))
    head = {"model": cfg.model.name, "seed": int(cfg.seed), "tokens": int(p.tokens),
            "machine": environment(cfg.threads, "cpu")["label"]}
    path = STREAMS / f"{cfg.model.name}.json"
    write_text(path, json.dumps(head)[:-1] + ', "sequences": [\n'
               + ",\n".join(json.dumps(s) for s in seqs) + "\n]}\n")  # a sequence a line
    print(f"wrote {path.relative_to(ROOT)}: {len(seqs)} sequences of {int(p.tokens)} tokens")
