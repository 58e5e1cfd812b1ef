"""Prometheus metrics named like vLLM's (vllm:*), so its dashboards carry over."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels, self.labels = ["model_name"], {"model_name": model_name}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (s).", labels,
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens (s).", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token (s).", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.running = Gauge("vllm:num_requests_running", "Requests holding a seat.", labels, registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a seat.", labels, registry=self.registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the KV cache in use (0-1): blocks on a "
                              "paged cache, seats on the slot cache.", labels, registry=self.registry)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Tokens of admitted sequences looked up in the "
                                      "prefix cache.", labels, registry=self.registry)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Of those, tokens found cached (not computed).", labels,
                                   registry=self.registry)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted (blocks freed, recomputed later).",
                                   labels, registry=self.registry)
        self.step_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per engine step.", labels,
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096),
                                     registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=self.registry)
        self.finished = Counter("vllm:request_success", "Finished requests by reason (stop, length, abort, error).",
                                labels + ["finished_reason"], registry=self.registry)

    def on_step(self, step: dict, num_seats: int, running: int, waiting: int):
        """Called from the engine thread after every forward pass."""
        lab = self.labels
        self.step_tokens.labels(**lab).observe(step["num_tokens"])
        self.prompt_tokens.labels(**lab).inc(step["num_prompt_tokens"])
        self.generation_tokens.labels(**lab).inc(step["useful_rows"])
        self.running.labels(**lab).set(running)
        self.waiting.labels(**lab).set(waiting)
        if "blocks_used" in step:
            self.kv_usage.labels(**lab).set(step["blocks_used"] / (step["blocks_used"] + step["blocks_free"]))
            self.prefix_queries.labels(**lab).inc(step["queried_tokens"])
            self.prefix_hits.labels(**lab).inc(step["cached_tokens"])
            self.preemptions.labels(**lab).inc(step["preempted"])
        else:
            self.kv_usage.labels(**lab).set(running / max(num_seats, 1))
