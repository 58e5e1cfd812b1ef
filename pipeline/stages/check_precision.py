"""Stage check_precision: each precision level's accuracy against fp32, the noise floor first
(reports/precision.json: {"levels": {level: figures}, "noise_floor": figures, ...})."""
from engine import threads
from engine.factory import build_net
from pipeline.config import ROOT
from pipeline.measuring import accuracy
from pipeline.measuring.fingerprint import environment
from pipeline.measuring.levels import level_nets
from pipeline.params import load
from pipeline.results import write_json
from pipeline.timings import timed_stage

if __name__ == "__main__":
    with timed_stage():
        cfg = load()
        threads.govern(int(cfg.threads), cfg.measure)  # this process runs the steps
        p = cfg.bench.precision
        base, model, tok, ref = accuracy.reference(cfg)
        seqs, stream = accuracy.stream_for(cfg.model.name, ref, tok, model.config.vocab_size, int(p.sequences),
                                           int(p.tokens), int(cfg.seed))
        other = accuracy.other_product(ref)
        built, skipped, _ = level_nets(cfg, p.levels, {(base.precision.dtype, base.precision.device): (model, tok)})
        levels = {name: net for name, (net, _, _) in built.items()}
        for net in levels.values():  # each level's teacher-forced pass in the arithmetic of its 1-row decode steps
            net.pin_kernels(0)  # (its prefill kernels, the fp32 values through other orders, differ less)
        floor_names = ["fp32, other product"]  # the floor on a share of the stream
        share = {floor_names[0]: max(int(p.batch), len(seqs) // int(p.floor_share))}
        pooled = accuracy.teacher_forced(ref, {floor_names[0]: build_net(model, kernel=other), **levels}, seqs,
                                         int(p.batch), float(p.near_tie), share)
        figures = {name: accuracy.summary(c) for name, c in pooled.items()}
        floor = figures[floor_names[0]]
        prompts = [s[:len(s) // 4] for s in seqs[:int(p.greedy_requests)]]
        fp32_out = accuracy.greedy(ref, prompts, int(p.greedy_tokens))
        alone = [accuracy.greedy(ref, [q], int(p.greedy_tokens))[0] for q in prompts[:int(p.greedy_alone)]]
        out = {"model": cfg.model.name, "reference": "fp32", "stream": stream,
               "positions": max(f["positions"] for f in figures.values()),
               "noise_floor": {**floor, **accuracy.greedy_agreement(fp32_out[:len(alone)], alone),
                               "comparisons": {n: figures[n] for n in floor_names}, "other_product": other},
               "levels": {}, "skipped": skipped, "near_tie": float(p.near_tie), "lossless_kld": float(p.lossless_kld),
               "lossless_top1": float(p.lossless_top1), "machine": environment(cfg.threads, cfg.precision.device)}
        for name, net in levels.items():
            level = {**figures[name], **accuracy.greedy_agreement(fp32_out, accuracy.greedy(net, prompts,
                                                                                          int(p.greedy_tokens)))}
            level["lossless"], level["arithmetic"] = accuracy.lossless(level, floor, p), net.arithmetic
            out["levels"][name] = level
            print(name, {k: v for k, v in level.items() if k != "first_divergences"}, flush=True)
        write_json(ROOT / "reports" / "precision.json", out)
