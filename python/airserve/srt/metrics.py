"""Prometheus metrics (`--enable-metrics`, served at `/metrics`), named like SGLang's.

Latencies and token counts are observed in the HTTP process as outputs arrive (what a client
sees); gauges and graph-runner counters come from the scheduler process's latest stats
snapshot, read at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "airserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
               0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300, 600)


class ServerMetrics:
    def __init__(self, model_name: str, scheduler_stats: Callable[[], dict]) -> None:
        disable_created_metrics()  # no `*_created` series: SGLang's dashboards do not use them
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._requests = Counter(f"{PREFIX}num_requests", "Finished requests, by finish reason",
                                 labels + ["finish_reason"], registry=r)
        self._prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of finished "
                                      "requests", labels, registry=r)
        self._generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens of "
                                          "finished requests", labels, registry=r)
        self._ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to first token",
                               labels, buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between output "
                              "tokens", labels, buckets=ITL_BUCKETS, registry=r)
        self._e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, end to "
                              "end", labels, buckets=E2E_BUCKETS, registry=r)
        self.model_name = model_name
        r.register(_SchedulerCollector(model_name, scheduler_stats))

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.labels(self.model_name).observe(seconds)

    def observe_itl(self, seconds_per_token: float, tokens: int) -> None:
        child = self._itl.labels(self.model_name)
        for _ in range(tokens):
            child.observe(seconds_per_token)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, e2e_seconds: float,
                         finish_reason: str) -> None:
        self._requests.labels(self.model_name, finish_reason).inc()
        self._prompt_tokens.labels(self.model_name).inc(prompt_tokens)
        self._generation_tokens.labels(self.model_name).inc(completion_tokens)
        self._e2e.labels(self.model_name).observe(e2e_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    """Gauges and counters read from each scheduler's stats snapshot at scrape time, one
    series per data-parallel replica (label `dp_rank`)."""

    def __init__(self, model_name: str, stats: Callable[[], list[dict]]) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator:
        replicas = self.stats() or [{}]
        families = []

        def family(kind, metric: str, doc: str, value, extra: tuple[str, ...] = ()) -> None:
            """`value(stats)` -> a number, or for `extra` labels a {label values: number}."""
            f = kind(PREFIX + metric, doc, labels=["model_name", "dp_rank", *extra])
            for rank, s in enumerate(replicas):
                name = [self.model_name, str(rank)]
                if extra:
                    for key, v in sorted(value(s or {}).items()):
                        f.add_metric(name + [key], v)
                else:
                    f.add_metric(name, value(s or {}))
            families.append(f)

        def cache(key: str, default=0):
            return lambda s: s.get("prefix_cache", {}).get(key, default)

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        family(gauge, "num_running_reqs", "Requests in the running batch",
               lambda s: s.get("num_running_reqs", 0))
        family(gauge, "num_queue_reqs", "Requests waiting to be scheduled",
               lambda s: s.get("num_waiting_reqs", 0))
        family(gauge, "token_usage", "Fraction of KV cache tokens in use",
               lambda s: s.get("kv_used_tokens", 0) / s["kv_total_tokens"]
               if s.get("kv_total_tokens") else 0.0)
        family(gauge, "max_total_num_tokens", "KV cache capacity in tokens",
               lambda s: s.get("kv_total_tokens", 0))
        family(counter, "graph_replays", "Decode steps replayed by the graph runner",
               lambda s: s.get("graph_replays", 0))
        family(counter, "eager_fallbacks", "Decode steps that ran eager instead of in the graph "
               "runner, by reason", lambda s: s.get("eager_fallbacks", {}), ("reason",))
        family(gauge, "cache_hit_rate", "Prefix cache hit rate (cached / looked-up prompt "
               "tokens)", cache("hit_rate", 0.0))
        family(gauge, "radix_cache_tokens", "Tokens held by the prefix cache",
               cache("cached_tokens"))
        family(gauge, "radix_cache_nodes", "Nodes of the prefix cache's tree", cache("nodes"))
        family(counter, "radix_cache_evicted_tokens", "Tokens evicted from the prefix cache",
               cache("evicted_tokens"))
        family(counter, "mixed_steps", "Forward passes that carried decode rows and a prefill "
               "chunk together", lambda s: s.get("mixed_steps", 0))
        family(gauge, "decode_chunked_prefill_size", "Prefill tokens per step while requests "
               "decode (0: no such budget)", lambda s: s.get("decode_chunked_prefill_size") or 0)
        family(counter, "prefill_budget_limited_steps", "Prefill steps cut short by the budget "
               "while requests decode", lambda s: s.get("prefill_budget_limited_steps", 0))
        family(counter, "interleaved_decode_steps", "Decode steps run between two prefill "
               "steps while prefill work waited", lambda s: s.get("interleaved_decode_steps", 0))
        family(counter, "num_retractions", "Requests retracted to free KV pages",
               lambda s: s.get("retractions", 0))
        return iter(families)
