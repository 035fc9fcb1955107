"""In-process counters of the relay, rendered in Prometheus text format for ``/metrics``.

No client library: a few labelled counters and one histogram behind a lock. The core's
``/metrics`` route appends ``METRICS.render()`` to its own lines.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

LAG_BUCKETS_S: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

COUNTERS: dict[str, tuple[str, str]] = {
    # name: (label name, help)
    "faceflow_relay_dispatches_total": ("outcome", "Dispatch attempts by outcome."),
    "faceflow_webhook_deliveries_total": ("outcome", "Webhook delivery attempts by outcome."),
    "faceflow_relay_transitions_total": ("to", "Job transitions written by the relay."),
    "faceflow_relay_reaped_total": ("reason", "Flow runs reaped by reason."),
    "faceflow_relay_loop_errors_total": ("loop", "Unexpected errors in relay loops."),
    "faceflow_relay_input_fetches_total": ("outcome", "Input URL fetches by outcome."),
}


@dataclass
class Histogram:
    """Cumulative histogram with fixed buckets (seconds)."""

    buckets: tuple[float, ...] = LAG_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(LAG_BUCKETS_S) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        """Record one observation."""
        index = next((i for i, b in enumerate(self.buckets) if value <= b), len(self.buckets))
        self.counts[index] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str) -> list[str]:
        """Prometheus exposition lines (``_bucket``, ``_sum``, ``_count``)."""
        out, running = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            running += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


class RelayMetrics:
    """Thread-safe registry of the relay's counters and the dispatch-lag histogram."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, defaultdict[str, int]] = {
            name: defaultdict(int) for name in COUNTERS
        }
        self._lag = Histogram()

    def inc(self, name: str, label: str, amount: int = 1) -> None:
        """Add to the counter ``name`` with label value ``label``."""
        with self._lock:
            self._counters[name][label] += amount

    def observe_dispatch_lag(self, seconds: float) -> None:
        """Record the time from a job's creation to its flow run's creation."""
        with self._lock:
            self._lag.observe(max(0.0, seconds))

    def value(self, name: str, label: str) -> int:
        """Current value of one counter (for tests and health output)."""
        with self._lock:
            return self._counters[name].get(label, 0)

    def render(self) -> str:
        """Every metric in Prometheus text exposition format."""
        lines: list[str] = []
        with self._lock:
            for name, (label_name, help_text) in COUNTERS.items():
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
                for label, value in sorted(self._counters[name].items()):
                    lines.append(f'{name}{{{label_name}="{label}"}} {value}')
            lag = "faceflow_dispatch_lag_seconds"
            lines += [
                f"# HELP {lag} Seconds from job creation to flow-run creation.",
                f"# TYPE {lag} histogram",
                *self._lag.lines(lag),
            ]
        return "\n".join(lines) + "\n"


METRICS = RelayMetrics()
