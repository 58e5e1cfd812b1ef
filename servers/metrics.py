"""Prometheus metrics named like vLLM's (vllm:*), so its dashboards carry over. Each attribute is the metric's
child for this server's model_name label (bound once: a streamed token observes without a label lookup)."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def bound(kind, name, doc, **kw):
            return kind(name, doc, ["model_name"], registry=self.registry, **kw).labels(model_name)

        self.ttft = bound(Histogram, "vllm:time_to_first_token_seconds", "Time to first token (s).",
                          buckets=LATENCY_BUCKETS)
        self.itl = bound(Histogram, "vllm:inter_token_latency_seconds", "Gap between consecutive tokens (s).",
                         buckets=LATENCY_BUCKETS)
        self.e2e = bound(Histogram, "vllm:e2e_request_latency_seconds", "Arrival to last token (s).",
                         buckets=LATENCY_BUCKETS)
        self.running = bound(Gauge, "vllm:num_requests_running", "Requests holding a seat.")
        self.waiting = bound(Gauge, "vllm:num_requests_waiting", "Requests queued for a seat.")
        self.kv_usage = bound(Gauge, "vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1): blocks on a "
                              "paged cache, seats on the slot cache.")
        self.prefix_queries = bound(Counter, "vllm:prefix_cache_queries", "Tokens of admitted sequences looked up in "
                                    "the prefix cache.")
        self.prefix_hits = bound(Counter, "vllm:prefix_cache_hits", "Of those, tokens found cached (not computed).")
        self.preemptions = bound(Counter, "vllm:num_preemptions", "Requests preempted (blocks freed, recomputed "
                                 "later).")
        self.step_tokens = bound(Histogram, "vllm:iteration_tokens_total", "Tokens per engine step.",
                                 buckets=TOKEN_BUCKETS)
        self.prompt_tokens = bound(Counter, "vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = bound(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.http_cpu = bound(Gauge, "lab:http_thread_cpu_seconds", "CPU seconds the HTTP event loop's thread has "
                              "used (parsing, detokenizing, JSON, SSE writes), read at each scrape.")
        self._finished = Counter("vllm:request_success", "Finished requests by reason (stop, length, abort, error).",
                                 ["model_name", "finished_reason"], registry=self.registry)

    def finished(self, reason: str) -> None:
        self._finished.labels(self.model_name, reason).inc()

    def on_step(self, step: dict, num_seats: int, running: int, waiting: int):
        """Called from the engine thread after every forward pass."""
        self.step_tokens.observe(step["num_tokens"])
        self.prompt_tokens.inc(step["num_prompt_tokens"])
        self.generation_tokens.inc(step["useful_rows"])
        self.running.set(running)
        self.waiting.set(waiting)
        if "blocks_used" in step:
            self.kv_usage.set(step["blocks_used"] / (step["blocks_used"] + step["blocks_free"]))
            self.prefix_queries.inc(step["queried_tokens"])
            self.prefix_hits.inc(step["cached_tokens"])
            self.preemptions.inc(step["preempted"])
        else:
            self.kv_usage.set(running / max(num_seats, 1))
