"""Prometheus metrics of one server. Latency histograms leave out requests that ended
in error or whose client went away, so neither passes for a fast answer."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gristmill_requests", "Requests by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("gristmill_request_errors", "Requests that ended in error, by error type",
                              ["error_type"], registry=r)
        self.client_disconnects = Counter(
            "gristmill_client_disconnects",
            "Requests whose client went away before their response ended (logged as status 499); also "
            "counted in gristmill_requests_total with finish_reason abort", registry=r)
        self.running = Gauge("gristmill_num_requests_running", "Requests running in the engine", registry=r)
        self.waiting = Gauge("gristmill_num_requests_waiting", "Requests waiting in the engine", registry=r)
        self.free_blocks = Gauge("gristmill_kv_free_blocks",
                                 "KV cache blocks a new request can take (unused cached prefixes included)",
                                 registry=r)
        self.total_blocks = Gauge("gristmill_kv_total_blocks", "KV cache blocks in all", registry=r)
        self.engine_dead = Gauge("gristmill_engine_dead", "1 while the engine is dead (or restarting)",
                                 registry=r)
        self.engine_restarts = Counter("gristmill_engine_restarts", "Engine cores started to replace a dead one",
                                       registry=r)
        self.engine_restart_seconds = Counter("gristmill_engine_restart_seconds",
                                              "Time spent restarting the engine", registry=r)
        self.cached_blocks = Gauge("gristmill_prefix_cache_cached_blocks",
                                   "KV cache blocks holding a prefix a new request can reuse", registry=r)
        self.prefix_hit_rate = Gauge("gristmill_prefix_cache_hit_rate",
                                     "Share of looked-up tokens found in the prefix cache", registry=r)
        self.prefix_queries = Counter("gristmill_prefix_cache_queries",
                                      "Tokens looked up in the prefix cache (each admitted request's)", registry=r)
        self.prefix_hits = Counter("gristmill_prefix_cache_hit_tokens",
                                   "Tokens found in the prefix cache, so not computed", registry=r)
        self.preemptions = Counter("gristmill_num_preemptions",
                                   "Requests preempted when the KV cache ran out (recomputed later)", registry=r)
        self._engine_totals: dict[str, float] = {}
        self.prompt_tokens = Counter("gristmill_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("gristmill_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("gristmill_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("gristmill_inter_token_latency_seconds", "Time between tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gristmill_e2e_request_latency_seconds", "Request latency, end to end",
                             buckets=_LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def engine_stats(self, stats: dict) -> None:
        """Take the engine's stats, sampled when /metrics is scraped."""
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.free_blocks.set(stats["num_free_blocks"])
        self.total_blocks.set(stats["num_total_blocks"])
        self.cached_blocks.set(stats["num_cached_blocks"])
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        self._advance(self.prefix_queries, "prefix_cache_queries", stats)
        self._advance(self.prefix_hits, "prefix_cache_hits", stats)
        self._advance(self.preemptions, "num_preemptions", stats)

    def _advance(self, counter: Counter, key: str, stats: dict) -> None:
        # The engine reports totals; a counter only goes up by what is new. Two scrapes
        # may finish out of order, so an older total changes nothing.
        total = stats[key]
        last = self._engine_totals.get(key, 0)
        if total > last:
            counter.inc(total - last)
            self._engine_totals[key] = total

    def request_failed(self, error_type: str) -> None:
        """One request ended in error: the error count of every failure, wherever it happened."""
        self.requests.labels("error").inc()
        self.errors.labels(error_type).inc()

    def client_disconnected(self) -> None:
        """One request ended because its client went away (its generation is aborted)."""
        self.requests.labels("abort").inc()
        self.client_disconnects.inc()


class RequestTimer:
    """Collects one request's timings; they reach the histograms only if it succeeds. A
    request is counted once, by the first of `finished`, `failed` and `disconnected`."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.counted = False
        self.start = time.monotonic()
        self.first: float | None = None
        self.last: float | None = None
        self.gaps: list[float] = []
        self.num_prompt_tokens = 0
        self.num_tokens = 0

    def tokens(self, count: int, at: float | None = None) -> None:
        """`count` more tokens arrived now (or at `at`, a `time.monotonic()` time)."""
        if count <= 0:
            return
        now = time.monotonic() if at is None else at
        if self.first is None:
            self.first = now
        elif self.last is not None:
            self.gaps.append((now - self.last) / count)
        self.last = now
        self.num_tokens += count

    def finished(self, finish_reason: str) -> None:
        if not self._count():
            return
        m = self.metrics
        m.requests.labels(finish_reason).inc()
        if self.first is not None:
            m.ttft.observe(self.first - self.start)
        for gap in self.gaps:
            m.itl.observe(gap)
        m.e2e.observe(time.monotonic() - self.start)

    def failed(self, exc: BaseException) -> None:
        if self._count():
            self.metrics.request_failed(type(exc).__name__)

    def disconnected(self) -> None:
        """Its client went away before the response ended."""
        if self._count():
            self.metrics.client_disconnected()

    def _count(self) -> bool:
        """Count its tokens, the first time it ends; False if it was counted already."""
        if self.counted:
            return False
        self.counted = True
        self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self.metrics.generation_tokens.inc(self.num_tokens)
        return True
