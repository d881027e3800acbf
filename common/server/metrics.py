"""`/metrics`: Prometheus text from prometheus_client, one registry per server.

Counted as requests go (on the event loop): prompt and generation tokens, finished requests by finish reason
("abort" too: a client that went away, an engine that failed or closed), and the TTFT / inter-token / end-to-end
latency histograms. Read from the engine's stats at each scrape (an EngineStats: read from an engine in this
process, or the latest one an engine process sent with a step): running and waiting requests, KV pages used and
total, preemptions.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from omnirun.engine import FinishReason, Request, StreamDelta
from omnirun.server.async_engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)


class _EngineState(Collector):
    def __init__(self, async_engine: AsyncEngine):
        self._async = async_engine

    def collect(self) -> Iterator:
        stats = self._async.client.stats()
        if stats is None:  # closed, or an engine process that has not stepped yet
            return
        yield GaugeMetricFamily("omnirun_requests_running", "Requests holding KV pages", value=stats.running)
        yield GaugeMetricFamily("omnirun_requests_waiting", "Requests queued in the scheduler", value=stats.waiting)
        yield GaugeMetricFamily(
            "omnirun_requests_waiting_first_token",
            "Requests the server submitted that have no token yet (what --max-queued-requests bounds)",
            value=self._async.num_waiting,
        )
        yield GaugeMetricFamily("omnirun_kv_pages_used", "KV-cache pages in use", value=stats.kv_pages_used)
        yield GaugeMetricFamily(
            "omnirun_kv_pages_cached",
            "KV-cache pages only the prefix cache keeps (evicted when new tokens need them)",
            value=stats.kv_pages_cached,
        )
        yield GaugeMetricFamily("omnirun_kv_pages_total", "KV-cache pages in the pool", value=stats.kv_pages_total)
        yield CounterMetricFamily(
            "omnirun_preemptions", "Requests preempted for KV room (recomputed later)", value=stats.preemptions
        )


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("omnirun_prompt_tokens", "Prompt tokens of submitted requests", registry=r)
        self.generation_tokens = Counter("omnirun_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "omnirun_requests_finished", "Requests finished, by finish reason", ["finish_reason"], registry=r
        )
        for reason in FinishReason:  # at 0 from the start, so that a rate over them is defined
            self.requests.labels(reason.value)
        self.ttft = Histogram(
            "omnirun_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "omnirun_inter_token_latency_seconds",
            "Time between two deltas of a request, per token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "omnirun_e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=_LATENCY_BUCKETS[3:] + (160, 320),
            registry=r,
        )
        r.register(_EngineState(async_engine))
        self._last_time: dict[int, float] = {}
        async_engine.on_submit.append(self._submitted)
        async_engine.on_delta.append(self._delta)
        async_engine.on_abort.append(self._aborted)

    def _submitted(self, requests: Sequence[Request]) -> None:
        self.prompt_tokens.inc(sum(len(r.prompt_ids) for r in requests))

    def _delta(self, request: Request, delta: StreamDelta, now: float) -> None:
        n = len(delta.token_ids)
        self.generation_tokens.inc(n)
        last = self._last_time.get(request.request_id)
        if n:
            if last is None:
                self.ttft.observe(now - request.arrival_time)
            else:
                for _ in range(n):
                    self.itl.observe((now - last) / n)
            self._last_time[request.request_id] = now
        if delta.finish_reason is not None:
            self._last_time.pop(request.request_id, None)
            self.requests.labels(delta.finish_reason).inc()
            self.e2e.observe(now - request.arrival_time)

    def _aborted(self, request: Request) -> None:
        self._last_time.pop(request.request_id, None)
        self.requests.labels(FinishReason.ABORT.value).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
