"""OpenVINO GenAI's continuous-batching pipeline under a closed loop, run by its own venv's python (no lab import):
`python -I openvino_driver.py SPEC.json`, SPEC: {"model", "prompts" (token ids), "slots", "threads", "cache_gb",
"hint", "stream": token sequences}. It loads the pipeline, prints "ready", then answers each stdin line "run C N T"
(the first N prompts, C at once, T new tokens each) with one JSON line: each request's {"start", "first", "end" (s
from the loop's start), "tokens"} and "wall" (s); and "tops K" with {"tops": [{"ids", "logprobs"}]}: the top-K of
every position of each stream sequence; a failure's: {"error": ...}."""
import json
import sys
import time

import numpy as np
import openvino as ov
import openvino_genai as genai


def pipeline(spec: dict) -> genai.ContinuousBatchingPipeline:
    """Up to `slots` sequences at once, the KV cache `cache_gb` GB, prefix caching off, `threads` threads, the
    activations' precision `hint` (f32: products in fp32 whatever the weights)."""
    sc = genai.SchedulerConfig()
    sc.max_num_seqs, sc.cache_size, sc.enable_prefix_caching = spec["slots"], spec["cache_gb"], False
    return genai.ContinuousBatchingPipeline(spec["model"], sc, "CPU", properties(spec))


def closed_loop(pipe, prompts: list[list[int]], c: int, max_tokens: int) -> dict:
    """`c` requests in flight, the next added as one finishes, greedy under ignore_eos."""
    gc = genai.GenerationConfig()
    gc.max_new_tokens, gc.ignore_eos, gc.do_sample = max_tokens, True, False
    todo, live, recs = list(enumerate(prompts)), {}, [None] * len(prompts)
    t0 = time.perf_counter()

    def add():
        i, ids = todo.pop(0)
        recs[i] = {"start": time.perf_counter() - t0, "first": None, "end": None, "tokens": []}
        live[i] = pipe.add_request(i, ov.Tensor(np.array([ids], dtype=np.int64)), gc)

    while todo and len(live) < c:
        add()
    while live:
        pipe.step()
        now = time.perf_counter() - t0
        for i, handle in list(live.items()):
            if handle.can_read():
                for out in handle.read().values():
                    recs[i]["tokens"] += list(out.generated_ids)
                if recs[i]["first"] is None and recs[i]["tokens"]:
                    recs[i]["first"] = now
            if handle.get_status() != genai.GenerationStatus.RUNNING:
                recs[i]["end"] = now
                del live[i]
                if todo:
                    add()
    return {"records": recs, "wall": time.perf_counter() - t0}


def properties(spec: dict) -> dict:
    """The CPU plugin's properties, the pipeline's and optimum-intel's model's alike."""
    return {"INFERENCE_NUM_THREADS": spec["threads"], "INFERENCE_PRECISION_HINT": spec["hint"]}


def tops(spec: dict, k: int) -> dict:
    """The exported model's top-k log-probabilities of the next token at every position but each sequence's last,
    through optimum-intel: the same IR, plugin and properties, its stateful attention instead of the pipeline's
    paged one (the pipeline returns no distributions)."""
    import torch
    from optimum.intel import OVModelForCausalLM
    model = OVModelForCausalLM.from_pretrained(spec["model"], device="CPU", ov_config=properties(spec))
    out = []
    for s in spec["stream"]:
        ids = torch.tensor([s])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
        lp, top = logits.double().log_softmax(-1).topk(k, dim=-1)
        out.append({"ids": top.tolist(), "logprobs": lp.tolist()})
    return {"tops": out}


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    pipe = pipeline(spec)
    print("ready", flush=True)
    for line in sys.stdin:
        verb, *args = line.split()
        try:
            got = tops(spec, int(args[0])) if verb == "tops" else closed_loop(pipe, spec["prompts"][:int(args[1])],
                                                                              int(args[0]), int(args[2]))
        except Exception as exc:  # the peer's own error, for its row
            got = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
