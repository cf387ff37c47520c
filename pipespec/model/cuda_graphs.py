"""CUDA graphs for steady decode/verify steps: one captured forward, and one captured draft pass, per
padded batch size.

A steady step is one where every request runs exactly 1 + K query rows and, on the last stage, every
request samples with K drafts. Its shapes then depend on the batch size alone, so the stage's whole
forward (and on the last stage the LM head over every row) is captured once per bucket of batch
sizes and replayed from static buffers; the MTP draft steps are a second graph. Between the two the
rejection sampler runs eagerly, with no host sync. Any other step (prefill, a request short of
drafts near its max_tokens, a batch larger than the largest bucket) runs eagerly.

Padding requests of a bucket live in one spare KV block that no request owns (`pad_block`): their
table rows name only that block, so whatever they write (target or draft KV) lands there.
"""
from __future__ import annotations

import logging
import time

import torch

from pipespec.model.attention import ForwardContext
from pipespec.plan import StepPlan

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, pad_block: int, max_blocks_per_seq: int):
        self.runner = runner
        self.k = runner.num_spec_tokens
        self.q = self.k + 1
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [min(max_batch, _BUCKETS[-1])]
        self.drafting = runner.proposer is not None
        nb, q, dev = self.buckets[-1], self.q, runner.device
        i64 = dict(dtype=torch.int64, device=dev)
        pad_positions = torch.arange(q, dtype=torch.int64).repeat(nb)
        # The static integer inputs are views of one flat buffer, so a step uploads them in one copy
        # (from a pinned mirror, without blocking). It starts as, and beyond the live batch is reset
        # to, padding values. The block tables come last: a batch of b uploads a prefix.
        pad = {
            "input_ids": torch.zeros(nb * q, dtype=torch.int64),
            "positions": pad_positions,
            "slots": pad_block * runner.block_size + pad_positions,
            "seq_lens": torch.full((nb,), q, dtype=torch.int64),
            "block_tables": torch.full((nb, max_blocks_per_seq), pad_block, dtype=torch.int64),
        }
        self._pad_flat = torch.cat([t.reshape(-1) for t in pad.values()])
        self._host_flat = self._pad_flat.clone().pin_memory()
        self._flat = self._pad_flat.to(dev)
        self.pad, self.host, self.ints = ({}, {}, {})
        offset = 0
        for name, t in pad.items():
            for views, flat in ((self.pad, self._pad_flat), (self.host, self._host_flat), (self.ints, self._flat)):
                views[name] = flat[offset:offset + t.numel()].view(t.shape)
            offset += t.numel()
        self._tables_offset = offset - pad["block_tables"].numel()
        self.query_start_loc = torch.arange(nb + 1, **i64) * q       # every request has q rows
        self.sample_rows = torch.arange(nb, **i64)
        self.num_drafts = torch.full((nb,), self.k, **i64)
        if not runner.is_first:
            h = runner.model.arch.hidden_size
            self.hidden_in = torch.zeros(nb * q, h, dtype=runner.dtype, device=dev)
            self.residual_in = torch.zeros_like(self.hidden_in)
        if self.drafting:
            self.next_token_ids = torch.full((nb,), -1, **i64)
            self.pad_last_rows = torch.arange(nb, **i64) * q
            self.last_rows = self.pad_last_rows.clone()
            self.last_tokens = torch.zeros(nb, **i64)
        self._graphs: dict[int, dict] = {}
        self._live = 0
        self.replays = 0                      # steps served from a graph (tests and logs read it)
        self._uploaded = torch.cuda.Event()

    # -- capture --------------------------------------------------------------------------------

    def _context(self, b: int) -> ForwardContext:
        r, n = self.runner, b * self.q
        attn = r.backend.prepare(self.query_start_loc[:b + 1], self.ints["seq_lens"][:b],
                                 self.ints["positions"][:n], self.ints["block_tables"][:b], r.block_size,
                                 max_query_len=self.q)
        return ForwardContext(self.ints["positions"][:n], self.ints["slots"][:n], r.backend, attn, r.kv_caches)

    def _forward(self, b: int, ctx: ForwardContext) -> dict:
        r, n = self.runner, b * self.q
        if r.is_first:
            hidden, residual = r.model(ctx, input_ids=self.ints["input_ids"][:n])
        else:
            hidden, residual = r.model(ctx, hidden=self.hidden_in[:n], residual=self.residual_in[:n])
        out = {"hidden": hidden, "residual": residual}
        if r.is_last:   # in a steady step every row is a verify row
            out["logits"] = r.model.compute_logits(hidden)
        return out

    def _draft(self, b: int, ctx: ForwardContext, hidden: torch.Tensor) -> torch.Tensor:
        r, n = self.runner, b * self.q
        return r.proposer.propose(r.backend, ctx, self.ints["input_ids"][:n], hidden,
                                  self.ints["block_tables"][:b], self.query_start_loc[:b + 1],
                                  self.next_token_ids[:b], self.last_rows[:b], self.last_tokens[:b],
                                  self.sample_rows[:b])

    @staticmethod
    def _capture(pool, fn):
        fn()                                  # warm-up: compiles kernels, settles the allocator
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
        return graph, out

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):      # largest first: smaller ones reuse its memory
            ctx = self._context(b)
            fwd_graph, out = self._capture(pool, lambda: self._forward(b, ctx))
            entry = {"forward": fwd_graph, "out": out}
            if self.drafting and self.runner.is_last:
                entry["draft"], entry["drafts"] = self._capture(pool, lambda: self._draft(b, ctx, out["hidden"]))
            self._graphs[b] = entry
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d batch sizes (up to %d, %d rows per request) in %.1f s",
                    len(self.buckets), self.buckets[-1], self.q, time.perf_counter() - start)

    # -- replay ---------------------------------------------------------------------------------

    def fits(self, plan: StepPlan) -> bool:
        """Whether `plan` (on the host) is a steady step this stage can replay."""
        b, q = plan.num_reqs, self.q
        if b == 0 or b > self.buckets[-1] or plan.num_tokens != b * q:
            return False
        if plan.block_tables.shape[1] > self.ints["block_tables"].shape[1]:
            return False
        if not bool((plan.query_lens() == q).all()):
            return False
        if self.runner.is_last:   # every request samples, verifying all K drafts
            return plan.sample_rows.shape[0] == b and bool((plan.num_drafts == self.k).all())
        return True

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def forward(self, plan: StepPlan, hidden: torch.Tensor | None, residual: torch.Tensor | None):
        """Replay the forward graph for a steady host `plan`; returns (hidden, residual) of its rows."""
        n_req, q = plan.num_reqs, self.q
        b = self._bucket(n_req)
        n = n_req * q
        per_token = {"input_ids": plan.input_ids, "positions": plan.positions, "slots": plan.slot_mapping}
        per_request = {"seq_lens": plan.seq_lens, "block_tables": plan.block_tables}
        self._uploaded.synchronize()          # the last step's upload has left the pinned buffer
        for fields, live, used in ((per_token, n, b * q), (per_request, n_req, b)):
            for name, value in fields.items():
                host = self.host[name]
                host[live:used].copy_(self.pad[name][live:used])
                if value.dim() == 2:
                    host[:live, :value.shape[1]].copy_(value)
                else:
                    host[:live].copy_(value)
        end = self._tables_offset + b * self.ints["block_tables"].shape[1]
        self._flat[:end].copy_(self._host_flat[:end], non_blocking=True)
        self._uploaded.record()
        if hidden is not None:
            self.hidden_in[:n].copy_(hidden)
            self.residual_in[:n].copy_(residual)
        entry = self._graphs[b]
        entry["forward"].replay()
        self.replays += 1
        self._live = n_req
        out = entry["out"]
        res = out["residual"][:n] if out["residual"] is not None else None
        return out["hidden"][:n], res

    def logits(self) -> torch.Tensor:
        """[B, 1 + K, V] of the step just replayed."""
        out = self._graphs[self._bucket(self._live)]["out"]["logits"]
        return out[:self._live * self.q].view(self._live, self.q, -1)

    def propose(self, last_rows: torch.Tensor, last_tokens: torch.Tensor) -> torch.Tensor:
        """Replay the draft graph of the step just replayed; returns drafts [B, K]."""
        n_req = self._live
        b = self._bucket(n_req)
        self.last_rows[:n_req].copy_(last_rows)
        self.last_tokens[:n_req].copy_(last_tokens)
        if b > n_req:
            self.last_rows[n_req:b].copy_(self.pad_last_rows[n_req:b])
        entry = self._graphs[b]
        entry["draft"].replay()
        return entry["drafts"][:n_req]

    @torch.inference_mode()
    def time_replay(self, batch: int, iters: int = 50) -> dict[str, float]:
        """Median GPU milliseconds of one replay of each graph of `batch`'s bucket, on padding inputs
        (for benchmarks: the device's share of a step, without the host's)."""
        self._flat.copy_(self._pad_flat)
        if self.drafting:
            self.last_rows.copy_(self.pad_last_rows)
        out = {}
        for name, graph in self._graphs[self._bucket(batch)].items():
            if not isinstance(graph, torch.cuda.CUDAGraph):
                continue
            times = []
            for _ in range(iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            out[f"{name}_gpu_ms"] = round(sorted(times)[len(times) // 2], 3)
        return out
