"""The server's /metrics in Prometheus' text format (names follow vLLM's, prefixed `lmlab:`).

The engine's counts are read when Prometheus scrapes (a collector), so the engine thread does no
bookkeeping for them; the time-to-first-token histogram is observed as each request's first token
arrives.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmlab.serving.async_engine import AsyncEngine

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
GAUGES = {  # engine.stats() key -> (metric, help)
    "waiting": ("num_requests_waiting", "sequences waiting for admission (new or preempted)"),
    "running": ("num_requests_running", "sequences in the running batch"),
    "kv_blocks_used": ("kv_blocks_used", "KV-cache blocks held by sequences"),
    "kv_blocks_total": ("kv_blocks_total", "KV-cache blocks in the pool"),
}
COUNTERS = {
    "requests": ("requests", "requests accepted"),
    "prompt_tokens": ("prompt_tokens", "prompt tokens of accepted requests"),
    "generation_tokens": ("generation_tokens", "tokens generated"),
    "preemptions": ("num_preemptions", "sequences preempted (blocks freed, recomputed later)"),
    "prefix_cache_queries": ("prefix_cache_queries", "full prompt blocks looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "full prompt blocks found in the prefix cache"),
}


class EngineCollector:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.engine, self.labels = engine, {"model_name": model_name}

    def collect(self):
        stats = self.engine.engine.stats()
        for key, (name, doc) in GAUGES.items():
            yield _one(GaugeMetricFamily(f"lmlab:{name}", doc, labels=list(self.labels)), self.labels, stats[key])
        for key, (name, doc) in COUNTERS.items():
            yield _one(CounterMetricFamily(f"lmlab:{name}", doc, labels=list(self.labels)), self.labels, stats[key])
        yield _one(GaugeMetricFamily("lmlab:generation_tokens_per_second", "generated tokens/s over the last 10 s",
                                     labels=list(self.labels)), self.labels, self.engine.tokens_per_s())


def _one(family, labels: dict[str, str], value: float):
    family.add_metric(list(labels.values()), value)
    return family


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.ttft = Histogram("lmlab:time_to_first_token_seconds", "time from a request's arrival to its first token",
                              ["model_name"], buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        engine.ttft_observers.append(self.ttft.observe)

    def render(self) -> bytes:
        return generate_latest(self.registry)
