"""/metrics: the server's Prometheus metrics, in a registry of its own (prometheus_client).

- histograms (P50/P90/P99 derivable with histogram_quantile): ``dstc_time_to_first_token_seconds``,
  ``dstc_inter_token_latency_seconds``, ``dstc_decode_step_seconds``, ``dstc_request_duration_seconds``;
- counters: ``dstc_prompt_tokens_total``, ``dstc_generation_tokens_total``, ``dstc_requests_total{finish_reason}``,
  ``dstc_rejected_requests_total{reason}`` (queue_full, invalid_request, not_ready, unauthorized, body_too_large,
  body_timeout); with ``--speculate``, ``dstc_speculative_proposed_total{position}`` and
  ``dstc_speculative_accepted_total{position}`` (draft tokens per draft position, 0 the first of a step: the
  acceptance rate at each is their ratio; openvino_genai's prompt lookup does not say what it proposed: accepted
  only) and ``dstc_speculative_verify_steps_total`` (requests' verify steps: the mean tokens a step gives a
  request is 1 + accepted / verify steps);
- gauges read when scraped: ``dstc_queue_depth``, ``dstc_running_batch_size``, ``dstc_kv_cache_usage_ratio``,
  ``dstc_generation_tokens_per_second`` (over the last 10 s), ``dstc_ready``, ``dstc_health_status`` (0 ok, 1 warn,
  2 alert) and ``dstc_health_check_status{metric}``;
- the artifact: ``dstc_artifact_info{model,backend,scheme,moe_lowering}`` (the lowering from the graph's metadata,
  empty for a dense model) and the compression stage's error summary from
  compression.json (``dstc_quantization_*``: bits per weight, KL and top-1 agreement against the uncompressed
  model, MoE routing agreement, and per layer the largest weight and output errors).

With ``--replicas N`` the engine's series (the histograms but the request duration, the token, request and
speculative counters, the queue, batch and KV-cache gauges) carry a ``replica`` label (its rank: a replacement
takes the rank of the replica it replaces), and ``dstc_replicas_ready``, ``dstc_replicas_target`` and
``dstc_replicas_replaced_total`` count them; the rest is the server's, over all replicas.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol, runtime_checkable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from toolchain.interface.reports import CompressionReport
from toolchain.serve.engine import Observer
from toolchain.serve.health import STATUSES, HealthMonitor

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.5, 0.75, 1.0,
                1.5, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25,
               0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 10.0


class LiveEngine(Protocol):
    """What the live gauges read of an Engine or a RemoteEngine."""

    @property
    def state(self) -> str: ...

    @property
    def queue_depth(self) -> int: ...

    @property
    def running(self) -> int: ...

    @property
    def max_batch(self) -> int: ...

    def kv_cache_usage(self) -> float: ...


@runtime_checkable
class ReplicaSet(Protocol):
    """An engine of several replicas (toolchain/serve/replicated.py): their gauges are labelled by replica."""

    target: int
    restarts: int

    def replica_stats(self) -> list[dict]: ...


class ServerMetrics(Observer):
    """The engine's Observer: each event goes to the Prometheus metrics and to the health monitor. With
    ``replica_label`` (dstc serve --replicas), the engine's own series carry a ``replica`` label, each replica's
    events going to ``replica(name)``'s Observer, and the health monitor judges all replicas together."""

    def __init__(self, health: HealthMonitor, *, replica_label: bool = False) -> None:
        self.health = health
        self.registry = CollectorRegistry()
        r = self.registry
        by = ["replica"] if replica_label else []
        self.ttft = Histogram("dstc_time_to_first_token_seconds", "Request arrival to its first generated token.",
                              by, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("dstc_inter_token_latency_seconds", "Time between two tokens of one request.",
                             by, buckets=ITL_BUCKETS, registry=r)
        self.step_seconds = Histogram("dstc_decode_step_seconds", "One engine step of the running batch.",
                                      by, buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("dstc_request_duration_seconds", "Request arrival to its last token.",
                                  buckets=DURATION_BUCKETS, registry=r)
        self.prompt_tokens = Counter("dstc_prompt_tokens", "Prompt tokens admitted to the running batch.", by,
                                     registry=r)
        self.generation_tokens = Counter("dstc_generation_tokens", "Tokens generated.", by, registry=r)
        self.requests = Counter("dstc_requests", "Requests finished, by finish reason.", [*by, "finish_reason"],
                                registry=r)
        # speculative decoding (dstc serve --speculate): per draft position, 0 the first draft of a step
        self.proposed = Counter("dstc_speculative_proposed", "Draft tokens proposed, by draft position.",
                                [*by, "position"], registry=r)
        self.accepted = Counter("dstc_speculative_accepted", "Draft tokens accepted, by draft position.",
                                [*by, "position"], registry=r)
        self.verify_steps = Counter("dstc_speculative_verify_steps",
                                    "Requests' verify steps (each gives its accepted drafts and one token).", by,
                                    registry=r)
        self.rejected = Counter("dstc_rejected_requests", "Requests refused, by reason.", ["reason"], registry=r)
        for reason in ("queue_full", "invalid_request", "not_ready", "unauthorized", "body_too_large", "body_timeout"):
            self.rejected.labels(reason)
        self._lock = threading.Lock()
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        # speculation's counts over all replicas, for /health
        self._verify_steps = 0
        self._proposed: list[int] = []
        self._accepted: list[int] = []
        self.engine: LiveEngine | None = None  # set by attach(), which registers the live gauges
        self._series = None if replica_label else _Series(self, ())
        self._replicas: dict[str, _Series] = {}

    def replica(self, name: str) -> Observer:
        """The Observer of one replica's engine (``replica_label``)."""
        with self._lock:
            return self._replicas.setdefault(name, _Series(self, (name,)))

    # -- Observer (the engine's thread) ------------------------------------------------------------------------

    def _single(self) -> _Series:
        assert self._series is not None, "with replica_label, each replica's events go to replica(name)"
        return self._series

    def first_token(self, seconds: float) -> None:
        self._single().first_token(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        self._single().inter_token(seconds, tokens)

    def tokens(self, prompt: int, generated: int) -> None:
        self._single().tokens(prompt, generated)

    def finished(self, reason: str) -> None:
        self._single().finished(reason)

    def step(self, seconds: float, batch: int) -> None:
        self._single().step(seconds, batch)

    def drafts(self, proposed: int | None, accepted: int) -> None:
        self._single().drafts(proposed, accepted)

    def _drafted(self, proposed: int | None, accepted: int) -> None:
        with self._lock:
            self._verify_steps += 1
            for totals, count in ((self._proposed, proposed or 0), (self._accepted, accepted)):
                totals += [0] * max(0, count - len(totals))
                for position in range(count):
                    totals[position] += 1

    def speculation(self) -> dict:
        """The acceptance counted so far (/health): per draft position, and the mean accepted drafts per verify
        step of a request."""
        with self._lock:
            steps, proposed, accepted = self._verify_steps, list(self._proposed), list(self._accepted)
        return {"verify_steps": steps, "proposed_per_position": proposed, "accepted_per_position": accepted,
                "acceptance_per_position": [round(a / p, 4) if p else None for a, p in zip(accepted, proposed)],
                "accepted_per_verify_step": round(sum(accepted) / steps, 4) if steps else None}

    def _generated(self, count: int) -> None:
        with self._lock:
            self._recent.append((time.monotonic(), count))

    # -- the API layer ------------------------------------------------------------------------------------------

    def reject(self, reason: str) -> None:
        self.rejected.labels(reason).inc()
        if reason == "queue_full":
            self.health.observe_rejected()

    def request_done(self, seconds: float) -> None:
        self.duration.observe(seconds)

    def tokens_per_second(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def attach(self, engine, artifact, model_name: str) -> None:
        """The live gauges read from ``engine``; the artifact's description and quantization error summary."""
        self.engine = engine
        self.registry.register(_LiveGauges(self))
        compression = artifact.manifest.provenance.report("compress", CompressionReport) if artifact.manifest else None
        info = Gauge("dstc_artifact_info", "The artifact served (value 1).",
                     ["model", "backend", "scheme", "moe_lowering"], registry=self.registry)
        info.labels(model_name, artifact.backend, compression.scheme if compression else "none",
                    artifact.moe_lowering or "").set(1)
        _quantization_gauges(self.registry, compression)


class _Series(Observer):
    """The engine's series of one replica (``labels``: its name) or of the single engine (no labels)."""

    def __init__(self, metrics: ServerMetrics, labels: tuple[str, ...]) -> None:
        self.metrics, self.labels = metrics, labels
        self.ttft = metrics.ttft.labels(*labels) if labels else metrics.ttft
        self.itl = metrics.itl.labels(*labels) if labels else metrics.itl
        self.step_seconds = metrics.step_seconds.labels(*labels) if labels else metrics.step_seconds
        self.prompt_tokens = metrics.prompt_tokens.labels(*labels) if labels else metrics.prompt_tokens
        self.generation_tokens = metrics.generation_tokens.labels(*labels) if labels else metrics.generation_tokens
        self.verify_steps = metrics.verify_steps.labels(*labels) if labels else metrics.verify_steps

    def first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.metrics.health.observe_ttft(seconds)

    def inter_token(self, seconds: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(seconds)
        self.metrics.health.observe_itl(seconds, tokens)

    def tokens(self, prompt: int, generated: int) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generated:
            self.generation_tokens.inc(generated)
            self.metrics._generated(generated)

    def finished(self, reason: str) -> None:
        self.metrics.requests.labels(*self.labels, reason).inc()

    def step(self, seconds: float, batch: int) -> None:
        self.step_seconds.observe(seconds)

    def drafts(self, proposed: int | None, accepted: int) -> None:
        self.metrics._drafted(proposed, accepted)
        self.verify_steps.inc()
        for position in range(accepted):
            self.metrics.accepted.labels(*self.labels, str(position)).inc()
        for position in range(proposed or 0):
            self.metrics.proposed.labels(*self.labels, str(position)).inc()


class _LiveGauges:
    """Gauges computed when /metrics is scraped."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def describe(self):
        return []

    def collect(self):
        engine, health = self.metrics.engine, self.metrics.health
        assert engine is not None  # registered by attach(), with the engine
        ready = engine.state == "ready"
        yield GaugeMetricFamily("dstc_ready", "1 when the model is loaded and requests are served.", float(ready))
        yield GaugeMetricFamily("dstc_max_batch_size", "Slots in the running batch.", engine.max_batch)
        live = {"dstc_queue_depth": ("Requests waiting for a slot in the running batch.", "queue_depth"),
                "dstc_running_batch_size": ("Requests in the running batch.", "running"),
                "dstc_kv_cache_usage_ratio": ("Share of the KV cache in use (0..1).", "kv_cache_usage")}
        if isinstance(engine, ReplicaSet):
            replicas = engine.replica_stats()
            for name, (doc, key) in live.items():
                family = GaugeMetricFamily(name, doc, labels=["replica"])
                for replica in replicas:
                    family.add_metric([replica["replica"]], float(replica.get(key) or 0))
                yield family
            yield GaugeMetricFamily("dstc_replicas_ready", "Replicas running with their model loaded.",
                                    sum(r["state"] == "ready" for r in replicas))
            yield GaugeMetricFamily("dstc_replicas_target", "Replicas asked for (--replicas).", engine.target)
            yield CounterMetricFamily("dstc_replicas_replaced", "Replicas that died and were replaced.",
                                      engine.restarts)
        else:
            yield GaugeMetricFamily("dstc_queue_depth", live["dstc_queue_depth"][0], engine.queue_depth)
            yield GaugeMetricFamily("dstc_running_batch_size", live["dstc_running_batch_size"][0], engine.running)
            yield GaugeMetricFamily("dstc_kv_cache_usage_ratio", live["dstc_kv_cache_usage_ratio"][0],
                                    engine.kv_cache_usage())
        yield GaugeMetricFamily("dstc_generation_tokens_per_second",
                                f"Tokens generated per second over the last {RATE_WINDOW_S:g} s.",
                                self.metrics.tokens_per_second())
        report = health.report()
        yield GaugeMetricFamily("dstc_health_status", "Health: 0 ok, 1 warn, 2 alert.",
                                STATUSES.index(report["status"]))
        checks = GaugeMetricFamily("dstc_health_check_status", "Each threshold's status: 0 ok, 1 warn, 2 alert.",
                                   labels=["metric"])
        for check in report["checks"]:
            checks.add_metric([check["metric"]], STATUSES.index(check["status"]))
        yield checks


def _quantization_gauges(registry: CollectorRegistry, compression: CompressionReport | None) -> None:
    if compression is None:
        return
    weights, model = compression.weights, compression.model
    scalars = {
        "dstc_quantization_bits_per_weight": ("Mean bits per weight of the compressed model.",
                                              weights.bits_per_weight),
        "dstc_quantization_size_bytes": ("Size of the compressed model files.", compression.size_bytes),
        "dstc_quantization_input_size_bytes": ("Size of the model before compression.",
                                               compression.input_size_bytes),
        "dstc_quantization_top1_agreement": ("Top-1 agreement with the uncompressed model on calibration text.",
                                             model.top1_agreement),
        "dstc_quantization_kl_mean_nats": ("Mean next-token KL(uncompressed || compressed) on calibration text.",
                                           model.kl_mean),
        "dstc_quantization_kl_max_nats": ("Largest next-token KL on calibration text.", model.kl_max),
        "dstc_quantization_routing_agreement_min": ("Lowest MoE routing agreement over layers.",
                                                    compression.routing_agreement_min),
    }
    for name, (doc, value) in scalars.items():
        if value is not None:
            Gauge(name, doc, registry=registry).set(value)
    per_layer = {
        "dstc_quantization_weight_error_max": ("Largest relative weight error ||W - Q(W)|| / ||W|| in the layer.",
                                               "weight_error_max"),
        "dstc_quantization_output_error_max": ("Largest relative output error ||XW - XQ(W)|| / ||XW|| in the layer.",
                                               "output_error_max"),
        "dstc_quantization_output_error_mean": ("Mean relative output error over the layer's weights.",
                                                "output_error_mean"),
    }
    for name, (doc, key) in per_layer.items():
        gauge = None
        for row in compression.layers:
            value = getattr(row, key)
            if value is not None:
                gauge = gauge or Gauge(name, doc, ["layer"], registry=registry)
                gauge.labels(str(row.layer)).set(value)
    if compression.routing:
        gauge = Gauge("dstc_quantization_routing_agreement", "MoE routing agreement per layer.", ["layer"],
                      registry=registry)
        for routing_row in compression.routing:
            gauge.labels(str(routing_row.layer)).set(routing_row.agreement)


def render(metrics: ServerMetrics) -> bytes:
    return generate_latest(metrics.registry)
