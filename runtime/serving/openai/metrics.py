"""Prometheus metrics of the OpenAI frontend: one private CollectorRegistry per server.

Latency histograms (TTFT, ITL, TPOT, end-to-end) are observed by the HTTP handlers, i.e. as the client
sees them. Engine state (requests running/waiting, KV blocks, speculative acceptance) is a snapshot the
engine-loop thread takes after each step and a custom collector reads, so a scrape never touches the engine.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from runtime.serving.stats import LoopStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector(Collector):
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.snap = LoopStats()

    def update(self, stats: LoopStats) -> None:
        """The engine loop's on_step (its thread): keep the latest snapshot."""
        with self._lock:
            self.snap = stats

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            s = self.snap
        yield GaugeMetricFamily("mtp_requests_running", "Requests scheduled in the engine", value=s.running)
        yield GaugeMetricFamily("mtp_requests_waiting", "Requests queued, not yet scheduled", value=s.waiting)
        yield GaugeMetricFamily("mtp_kv_blocks_used", "KV pool blocks in use", value=s.kv_blocks_used)
        yield GaugeMetricFamily("mtp_kv_blocks_free", "KV pool blocks free", value=s.kv_blocks_free)
        yield CounterMetricFamily("mtp_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                  value=s.prefix_hit_tokens)  # fmt: skip
        yield CounterMetricFamily("mtp_engine_generated_tokens", "Output tokens the engine generated (incl. aborted)",
                                  value=s.generated_tokens)  # fmt: skip
        yield CounterMetricFamily("mtp_spec_verify_steps", "Decode verify steps (one per request per step)",
                                  value=s.num_verify_steps)  # fmt: skip
        yield GaugeMetricFamily("mtp_spec_mean_acceptance_length",
                                "Tokens emitted per verify step, bonus token included", value=s.mean_acceptance_length)
        proposed = CounterMetricFamily("mtp_spec_draft_tokens", "Draft tokens proposed, by draft position",
                                       labels=["position"])  # fmt: skip
        accepted = CounterMetricFamily("mtp_spec_accepted_tokens", "Draft tokens accepted, by draft position",
                                       labels=["position"])  # fmt: skip
        rate = GaugeMetricFamily("mtp_spec_acceptance_rate", "Accepted / proposed, by draft position",
                                 labels=["position"])  # fmt: skip
        for i, (p, a) in enumerate(zip(s.proposed_per_position, s.accepted_per_position, strict=True)):
            proposed.add_metric([str(i)], p)
            accepted.add_metric([str(i)], a)
            rate.add_metric([str(i)], a / p if p else 0.0)
        yield proposed
        yield accepted
        yield rate
        step = s.last_step  # the engine's record of its last step (runtime/core/step_record.py)
        yield GaugeMetricFamily("mtp_step_seconds", "Wall seconds of the engine's last step",
                                value=step.total_seconds if step else 0.0)  # fmt: skip
        yield GaugeMetricFamily("mtp_spec_draft_length", "Draft depths of the engine's last step",
                                value=step.draft_depths if step else 0)  # fmt: skip
        yield GaugeMetricFamily("mtp_spec_requests_drafting", "Requests that drafted in the engine's last step",
                                value=step.num_drafting if step else 0)  # fmt: skip
        yield CounterMetricFamily("mtp_spec_acceptance_collapse_warnings",
                                  "Windows whose draft acceptance fell below a third of the running average (each "
                                  "logged once; docs/RUNTIME.md, Acceptance guards)", value=s.acceptance_collapse_warnings)


class ServeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.engine = _EngineCollector()
        r.register(self.engine)
        self.ttft = Histogram("mtp_time_to_first_token_seconds", "Request arrival to first output token",
                              registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.itl = Histogram("mtp_inter_token_latency_seconds", "Time between consecutive output chunks, per token",
                             registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.tpot = Histogram("mtp_time_per_output_token_seconds", "(last - first token time) / (output tokens - 1)",
                              registry=r, buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.e2e = Histogram("mtp_request_latency_seconds", "Request arrival to its last token", registry=r,
                             buckets=_LATENCY_BUCKETS)  # fmt: skip
        self.requests = Counter("mtp_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("mtp_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.output_tokens = Counter("mtp_generation_tokens", "Output tokens", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
