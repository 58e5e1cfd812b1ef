"""Prometheus metrics named like vLLM's (vllm:*), so its dashboards carry over. Each attribute is the metric's
child for this server's model_name label (bound once: a streamed token observes without a label lookup)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# attribute: (metric type, name, help, histogram buckets or None)
SPECS = {
    "ttft": (Histogram, "vllm:time_to_first_token_seconds", "Time to first token (s).", LATENCY_BUCKETS),
    "itl": (Histogram, "vllm:inter_token_latency_seconds", "Gap between consecutive tokens (s).", LATENCY_BUCKETS),
    "e2e": (Histogram, "vllm:e2e_request_latency_seconds", "Arrival to last token (s).", LATENCY_BUCKETS),
    "running": (Gauge, "vllm:num_requests_running", "Requests running.", None),
    "waiting": (Gauge, "vllm:num_requests_waiting", "Requests queued.", None),
    "kv_usage": (Gauge, "vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1): blocks on a paged cache, "
                 "seats on the slot cache.", None),
    "prefix_queries": (Counter, "vllm:prefix_cache_queries", "Tokens of admitted sequences looked up in the prefix "
                       "cache.", None),
    "prefix_hits": (Counter, "vllm:prefix_cache_hits", "Of those, tokens found cached (not computed).", None),
    "preemptions": (Counter, "vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).", None),
    "step_tokens": (Histogram, "vllm:iteration_tokens_total", "Tokens per engine step.", TOKEN_BUCKETS),
    "prompt_tokens": (Counter, "vllm:prompt_tokens", "Prompt tokens processed.", None),
    "generation_tokens": (Counter, "vllm:generation_tokens", "Tokens generated.", None),
    "spec_drafts": (Counter, "vllm:spec_decode_num_drafts", "Rows verified with drafted tokens.", None),
    "spec_draft_tokens": (Counter, "vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.", None),
    "spec_accepted": (Counter, "vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", None),
    "http_cpu": (Gauge, "lab:http_thread_cpu_seconds", "CPU seconds the HTTP event loop's thread has used (parsing, "
                 "detokenizing, JSON, SSE writes), read at each scrape.", None),
}


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        for attr, (kind, name, doc, buckets) in SPECS.items():
            extra = {"buckets": buckets} if buckets else {}
            setattr(self, attr, kind(name, doc, ["model_name"], registry=self.registry, **extra).labels(model_name))
        self._finished = Counter("vllm:request_success", "Finished requests by reason (stop, length, abort, error).",
                                 ["model_name", "finished_reason"], registry=self.registry)

        self._per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Drafted tokens accepted at each "
                                "position of their row's draft (0: the first).", ["model_name", "position"],
                                registry=self.registry)

    def on_speculation(self, drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> None:
        """A step's speculative decoding (deltas): rows verified with drafts, tokens drafted, accepted, and accepted
        per draft position."""
        self.spec_drafts.inc(drafts)
        self.spec_draft_tokens.inc(draft_tokens)
        self.spec_accepted.inc(accepted)
        for pos, n in enumerate(per_pos):
            if n:
                self._per_pos.labels(self.model_name, str(pos)).inc(n)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def on_step(self, tokens: int, prompt_tokens: int, generated: int, running: int, waiting: int, kv_usage: float,
                prefix: tuple[int, int, int] | None = None) -> None:
        """After every forward pass (from the worker's thread): its tokens, prompt tokens and tokens kept; the
        requests running and waiting; the KV cache's used fraction; on a paged cache (prefix-cache queried tokens,
        hit tokens, preemptions)."""
        self.step_tokens.observe(tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(generated)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if prefix is not None:
            self.prefix_queries.inc(prefix[0])
            self.prefix_hits.inc(prefix[1])
            self.preemptions.inc(prefix[2])
