"""Prometheus metrics under vLLM-like names with a `pipespec:` prefix, in a per-server registry."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name, doc):
            return Gauge(f"pipespec:{name}", doc, labels, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(f"pipespec:{name}", doc, labels, registry=r).labels(model_name)

        def histogram(name, doc):
            return Histogram(f"pipespec:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.preemptions = gauge("num_preemptions", "Requests preempted so far (KV cache full).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.ttft = histogram("time_to_first_token_seconds", "Time from request arrival to its first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token.")
        self._finished = Counter("pipespec:request_success", "Finished requests by finish reason.",
                                 labels + ["finished_reason"], registry=r)
        self._model = model_name
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative draft rounds.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_per_pos = Counter("pipespec:spec_decode_num_accepted_tokens_per_pos",
                                     "Accepted draft tokens by draft position.", labels + ["position"], registry=r)
        self._spec_seen: dict = {}
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache (on admission).")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens whose KV the prefix cache held.")
        self._spec_k_steps = Counter("pipespec:spec_decode_steps_per_k",
                                     "Steps by the K adaptive K chose for them.", labels + ["k"], registry=r)

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model, reason).inc()

    def update_engine(self, stats: dict) -> None:
        """Refresh gauges and advance speculative counters from the engine's cumulative stats."""
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        self.kv_usage.set(stats.get("kv_cache_usage", 0.0))
        self.preemptions.set(stats.get("num_preemptions", 0))
        spec = stats.get("spec_decode") or {}
        for key, counter in (("num_drafts", self.spec_drafts), ("num_draft_tokens", self.spec_draft_tokens),
                             ("num_accepted_tokens", self.spec_accepted)):
            self._advance(key, spec.get(key, 0), counter)
        for pos, value in enumerate(spec.get("accepted_per_position", [])):
            self._advance(("pos", pos), value, self._spec_per_pos.labels(self._model, str(pos)))
        cache = stats.get("prefix_cache") or {}
        self._advance("pc_queries", cache.get("queries", 0), self.prefix_cache_queries)
        self._advance("pc_hits", cache.get("hits", 0), self.prefix_cache_hits)
        for k, value in enumerate((spec.get("adaptive_k") or {}).get("k_steps", [])):
            self._advance(("k", k), value, self._spec_k_steps.labels(self._model, str(k)))

    def _advance(self, key, total: int, counter) -> None:
        delta = total - self._spec_seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
            self._spec_seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
