"""The model's Prometheus metrics on Triton's metrics port, through the Python backend's custom-metrics API.

Per draft position: proposed/accepted counters and the acceptance rate; the mean acceptance length; and the
serving state the soak test reads: request outcomes, preemptions, KV blocks in use and requests in flight.
`pb_utils` is passed in (it exists only inside the stub). Any failure disables the export and is logged once:
metrics must never take the serving loop down.
"""

from __future__ import annotations

from typing import Any

from runtime.serving.stats import OUTCOMES, LoopStats


class MetricsExporter:
    def __init__(self, pb_utils: Any, model: str, k: int) -> None:
        self.k = k
        self.ok = False
        self.error = ""
        self._metrics: list = []
        self._families: list = []
        try:
            fam = pb_utils.MetricFamily

            def family(name: str, kind: Any, description: str) -> Any:
                f = fam(name=name, kind=kind, description=description)
                self._families.append(f)
                return f

            proposed = family("mtp_draft_tokens_proposed_total", fam.COUNTER,
                              "MTP draft tokens proposed, by draft position (0 = first draft)")  # fmt: skip
            accepted = family("mtp_draft_tokens_accepted_total", fam.COUNTER,
                              "MTP draft tokens accepted, by draft position (0 = first draft)")  # fmt: skip
            rate = family("mtp_draft_acceptance_rate", fam.GAUGE,
                          "accepted / proposed draft tokens by position, since the model loaded")  # fmt: skip
            length = family("mtp_mean_acceptance_length", fam.GAUGE,
                            "tokens emitted per decode verify step, bonus token included")  # fmt: skip
            requests = family("mtp_requests_total", fam.COUNTER,
                              "requests by outcome: admitted = finished + cancelled + failed once idle; "
                              "rejected never reached the engine")  # fmt: skip
            preempt = family("mtp_preemptions_total", fam.COUNTER, "requests preempted for KV blocks")
            blocks = family("mtp_kv_blocks_used", fam.GAUGE, "KV blocks held (0 when idle: no leak)")
            active = family("mtp_requests_active", fam.GAUGE, "requests in the engine loop")
            generated = family("mtp_generated_tokens_total", fam.COUNTER,
                               "output tokens the engine generated (also those of requests cancelled later)")  # fmt: skip
            collapses = family("mtp_acceptance_collapse_warnings_total", fam.COUNTER,
                               "windows whose draft acceptance fell below a third of the running average")  # fmt: skip
            labels = [{"model": model, "position": str(i)} for i in range(k)]
            self._proposed = [proposed.Metric(labels=lab) for lab in labels]
            self._accepted = [accepted.Metric(labels=lab) for lab in labels]
            self._rate = [rate.Metric(labels=lab) for lab in labels]
            self._length = length.Metric(labels={"model": model})
            self._requests = {o: requests.Metric(labels={"model": model, "outcome": o}) for o in OUTCOMES}
            self._preempt = preempt.Metric(labels={"model": model})
            self._blocks = blocks.Metric(labels={"model": model})
            self._active = active.Metric(labels={"model": model})
            self._generated = generated.Metric(labels={"model": model})
            self._collapses = collapses.Metric(labels={"model": model})
            self._metrics = [*self._proposed, *self._accepted, *self._rate, self._length, *self._requests.values(),
                             self._preempt, self._blocks, self._active, self._generated, self._collapses]  # fmt: skip
            self._last: dict[str, int] = {}
            self.ok = True
        except Exception as e:
            self.error = str(e)
            self.close()

    def _count(self, metric: Any, key: str, value: int) -> None:
        """Counters only increment: add what changed since the last export."""
        delta = value - self._last.get(key, 0)
        if delta:
            metric.increment(delta)
        self._last[key] = value

    def export(self, s: LoopStats) -> str | None:
        """Update every metric from the engine loop's snapshot; returns the error (and disables the export)."""
        if not self.ok:
            return None
        try:
            rates = s.acceptance_rate_per_position
            for i in range(self.k):
                self._count(self._proposed[i], f"p{i}", s.proposed_per_position[i])
                self._count(self._accepted[i], f"a{i}", s.accepted_per_position[i])
                self._rate[i].set(rates[i])
            self._length.set(s.mean_acceptance_length)
            for outcome, metric in self._requests.items():
                self._count(metric, outcome, s.outcomes[outcome])
            self._count(self._preempt, "preempt", s.num_preemptions)
            self._blocks.set(s.kv_blocks_used)
            self._active.set(s.active)
            self._count(self._generated, "generated", s.generated_tokens)
            self._count(self._collapses, "collapses", s.acceptance_collapse_warnings)
        except Exception as e:
            self.ok = False
            return f"metrics update failed, disabling it: {e}"
        return None

    def close(self) -> None:
        """Metric objects must go before their MetricFamily (the backend's rule)."""
        self.ok = False
        self._metrics.clear()
        for name in ("_proposed", "_accepted", "_rate", "_length", "_requests", "_preempt", "_blocks", "_active", "_generated"):
            self.__dict__.pop(name, None)
        self._families.clear()
