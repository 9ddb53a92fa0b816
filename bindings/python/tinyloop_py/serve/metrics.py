"""Prometheus text (exposition format 0.0.4) for the Ray Serve deployment: the ingress's request
counts, tokens and latency histograms, and every engine replica's queue, KV pool and step counts,
labelled by replica. The names are those of ``tinyloop MODEL serve``'s /metrics where they
overlap. The engine replicas report their stats to a :class:`StatsBoard`, one per deployment."""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Tuple

#: Upper bounds (seconds) of the latency histograms.
SECONDS_BOUNDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: Engine stats as metrics: (name, type, help, key of ``Engine.stats()``).
ENGINE_METRICS = (
    ("tinyloop_engine_steps_total", "counter", "Steps the engine ran.", "steps"),
    ("tinyloop_engine_rows_total", "counter",
     "Rows the engine's steps carried (prompt and decode).", "rows"),
    ("tinyloop_engine_tokens_total", "counter", "Tokens the engine generated.", "tokens"),
    ("tinyloop_engine_preemptions_total", "counter",
     "Requests that gave their KV pages up to older ones.", "preemptions"),
    ("tinyloop_queued_requests", "gauge", "Requests waiting for admission.", "queued"),
    ("tinyloop_running_requests", "gauge", "Requests running.", "running"),
    ("tinyloop_kv_pool_pages", "gauge", "Pages of the KV pool.", "pool_pages"),
    ("tinyloop_kv_pool_pages_used", "gauge", "Pages held by running requests.", "pages_used"),
    ("tinyloop_kv_pool_pages_cached", "gauge",
     "Pages nobody holds that keep a prompt prefix for later requests.", "cached_pages"),
    ("tinyloop_engine_prompt_tokens_total", "counter",
     "Prompt tokens of the requests the engine finished.", "prompt_tokens"),
    ("tinyloop_engine_prompt_tokens_cached_total", "counter",
     "Of those, the tokens taken from cached pages instead of computed.", "cached_tokens"),
)


class Histogram:
    """A cumulative histogram over :data:`SECONDS_BOUNDS`."""

    def __init__(self) -> None:
        self.counts = [0] * len(SECONDS_BOUNDS)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        for i, bound in enumerate(SECONDS_BOUNDS):
            if seconds <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += seconds

    def render(self, out: List[str], name: str, help: str) -> None:
        out.append(f"# HELP {name} {help}\n# TYPE {name} histogram")
        for count, bound in zip(self.counts, SECONDS_BOUNDS):
            out.append(f'{name}_bucket{{le="{bound}"}} {count}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {self.sum}\n{name}_count {self.count}")


class IngressMetrics:
    """What the ingress counts (one set per ingress replica)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.responses: Dict[Tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.retries = 0
        self.first_token = Histogram()
        self.request = Histogram()

    def count(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, status)
            self.responses[key] = self.responses.get(key, 0) + 1

    def first(self, started: float) -> None:
        with self._lock:
            self.first_token.observe(time.monotonic() - started)

    def finished(self, endpoint: str, started: float, prompt_tokens: int, tokens: int) -> None:
        self.count(endpoint, 200)
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += tokens
            self.request.observe(time.monotonic() - started)

    def retried(self) -> None:
        with self._lock:
            self.retries += 1

    def render(self, replicas: Dict[str, Dict[str, int]]) -> str:
        """The text of /metrics; ``replicas``: each engine replica's stats by replica id."""
        out = ["# HELP tinyloop_requests_total Responses by endpoint and HTTP status.",
               "# TYPE tinyloop_requests_total counter"]
        with self._lock:
            for (endpoint, status), n in sorted(self.responses.items()):
                labels = f'endpoint="{endpoint}",status="{status}"'
                out.append(f"tinyloop_requests_total{{{labels}}} {n}")
            scalars = [
                ("tinyloop_prompt_tokens_total", "counter",
                 "Prompt tokens of finished requests.", self.prompt_tokens),
                ("tinyloop_generated_tokens_total", "counter",
                 "Tokens returned by finished requests.", self.completion_tokens),
                ("tinyloop_replica_retries_total", "counter",
                 "Requests sent again because their replica died before they returned text.",
                 self.retries),
                ("tinyloop_engine_replicas", "gauge",
                 "Engine replicas that reported their stats lately.", len(replicas)),
            ]
            for name, kind, help, value in scalars:
                out.append(f"# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}")
            for name, kind, help, key in ENGINE_METRICS:
                out.append(f"# HELP {name} {help}\n# TYPE {name} {kind}")
                for replica, stats in sorted(replicas.items()):
                    out.append(f'{name}{{replica="{replica}"}} {stats.get(key, 0)}')
            self.first_token.render(out, "tinyloop_time_to_first_token_seconds",
                                    "From a request's arrival to its first token.")
            self.request.render(out, "tinyloop_request_seconds",
                                "From a request's arrival to its end.")
        return "\n".join(out) + "\n"


class StatsBoard:
    """The latest stats of each engine replica of one deployment (a Ray actor that the Serve
    controller runs beside the deployment). A replica that stops reporting for ``ttl_s`` is
    dropped, so a killed replica leaves the board by itself."""

    def __init__(self, ttl_s: float = 10.0):
        self._ttl_s = ttl_s
        self._stats: Dict[str, Tuple[float, Dict[str, int]]] = {}

    def put(self, replica: str, stats: Optional[Dict[str, int]]) -> None:
        """Record ``replica``'s stats; None removes it (the replica is stopping)."""
        if stats is None:
            self._stats.pop(replica, None)
        else:
            self._stats[replica] = (time.monotonic(), stats)

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        now = time.monotonic()
        self._stats = {r: v for r, v in self._stats.items() if now - v[0] <= self._ttl_s}
        return {r: stats for r, (_, stats) in self._stats.items()}
