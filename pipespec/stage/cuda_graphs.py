"""CUDA graphs of a stage's steady steps: the step's forward and, on the last stage, its finish
(drafting, the result, the carry: `stage/result.py`), replayed from static buffers, one pair per
padded batch size and per K a step may use (`GraphsByK`).

A steady step is one where every request runs exactly 1 + K query rows and, on the last stage, every
request samples with K draft rows (its real drafts, then dummy rows the scheduler pads a short line
with, which verification masks by the uploaded count). Its shapes then depend on the batch size
alone, so the stage's whole forward (on the last stage with the LM head over every row, all of them
verify rows, and greedy verification) is captured once per bucket of batch sizes, and the finish is
a second graph. A greedy step is then two replays and an upload; a step that samples verifies
eagerly between them, with no host sync. Any other step runs eagerly (`Stage._forward`).

The graphs read a typed static buffer (`StepInts`, views of one flat int64 tensor uploaded in one
copy from a pinned mirror) and the attention metadata the backend built over it at capture
(`capture_metadata`; `before_replay` is its hook to refresh anything a replay cannot read there).
Padding requests of a bucket live in one spare KV block that no request owns (`pad_block`): their
table rows name only that block, so whatever they write (target or draft KV) lands there. Models with
linear-attention layers likewise give them a spare state slot (`pad_slot`); in a steady step every
request verifies (or, without speculation, none does), so the graph's state updates need no host
branch (`LinearFlags.steady`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, fields

import torch

from pipespec.kernels import pdl_scope
from pipespec.layout import Carry, StepLayout, carry_in
from pipespec.model.attention import AttentionBackend, ForwardContext, KVCache
from pipespec.model.linear_state import LinearFlags, LinearMeta
from pipespec.speculative.rejection import verify_greedy
from pipespec.stage.result import finish_step
from pipespec.stage.target import run_target

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class Forward:
    """What a stage's forward leaves for verification and drafting in the same step."""

    layout: StepLayout                 # on the stage's device (a replay: the live rows of its buffers)
    ctx: ForwardContext | None         # None when replayed: drafting then replays too
    hidden: torch.Tensor
    residual: torch.Tensor | None
    logits: torch.Tensor | None = None  # [rows, V] of every row, when the forward computed them


@dataclass
class StepInts:
    """The integer inputs of a steady step of `nb` requests of `q` rows, as views of one flat tensor
    (block tables last, so a batch of b uploads a prefix)."""

    input_ids: torch.Tensor        # [nb * q]
    positions: torch.Tensor        # [nb * q]
    slot_mapping: torch.Tensor     # [nb * q]
    mtp_input_ids: torch.Tensor    # [nb * q]
    seq_lens: torch.Tensor         # [nb]
    state_slots: torch.Tensor      # [nb] linear-attention state slot (models that have such layers)
    state_commit: torch.Tensor     # [nb] candidate state to commit first (-1: none)
    carried: torch.Tensor          # [nb] previous result's row of its first input token (-1: none)
    req_real_drafts: torch.Tensor  # [nb] real drafts of its line (the rest of its K rows: dummies)
    block_tables: torch.Tensor     # [nb, W]

    PER_TOKEN = ("input_ids", "positions", "slot_mapping", "mtp_input_ids")
    PER_REQUEST = ("seq_lens", "state_slots", "state_commit", "carried", "req_real_drafts")

    @classmethod
    def views(cls, flat: torch.Tensor, like: "StepInts") -> "StepInts":
        out, at = {}, 0
        for f in fields(cls):
            shape = getattr(like, f.name).shape
            n = shape.numel()
            out[f.name] = flat[at:at + n].view(shape)
            at += n
        return cls(**out)

    def flat(self) -> torch.Tensor:
        return torch.cat([getattr(self, f.name).reshape(-1) for f in fields(self)])


def _padding(nb: int, q: int, pad_block: int, block_size: int, max_blocks: int, pad_slot: int) -> StepInts:
    """Padding requests: every row in the spare block, every draft real (what they verify is dropped)."""
    positions = torch.arange(q, dtype=torch.int64).repeat(nb)
    return StepInts(input_ids=torch.zeros(nb * q, dtype=torch.int64), positions=positions,
                    slot_mapping=pad_block * block_size + positions,
                    mtp_input_ids=torch.zeros(nb * q, dtype=torch.int64),
                    seq_lens=torch.full((nb,), q, dtype=torch.int64),
                    state_slots=torch.full((nb,), pad_slot, dtype=torch.int64),
                    state_commit=torch.full((nb,), -1, dtype=torch.int64),
                    carried=torch.full((nb,), -1, dtype=torch.int64),
                    req_real_drafts=torch.full((nb,), q - 1, dtype=torch.int64),
                    block_tables=torch.full((nb, max_blocks), pad_block, dtype=torch.int64))


@dataclass
class _Bucket:
    layout: StepLayout
    forward: torch.cuda.CUDAGraph
    out: Forward
    attn: object                       # the backend's metadata over the static buffers
    finish: torch.cuda.CUDAGraph | None = None     # last stage: drafting, the result, the carry
    data: torch.Tensor | None = None


class CudaGraphs:
    host_buffers = ("_host_flat", "_pad_flat", "pad", "host")   # host mirrors, by design (device check)

    def __init__(self, model, drafter, backend: AttentionBackend, kv_caches: list[KVCache], block_size: int,
                 num_spec_tokens: int, max_batch: int, pad_block: int, max_blocks_per_seq: int,
                 linear_states: list | None = None, pad_slot: int = 0, mixed_k: bool = False,
                 carry: Carry | None = None, fill=carry_in):
        """`mixed_k`: steps of other K run between this set's (adaptive K), so a K = 0 step may follow
        a verify step and must adopt its candidate linear-attention state (a masked commit).
        `carry`: async scheduling's buffers of the previous step's result, which the forward graph
        reads where a request's line is carried (`carry_in`, or `fill`: the same in one kernel)."""
        self.carry, self.fill = carry, fill
        self.model, self.drafter, self.backend, self.kv_caches = model, drafter, backend, kv_caches
        self.mixed_k = mixed_k
        self.linear_states = linear_states
        self.block_size = block_size
        self.num_spec_tokens = num_spec_tokens
        self.rows_per_req = num_spec_tokens + 1
        self.is_first, self.is_last = model.model.is_first, model.model.is_last
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [min(max_batch, _BUCKETS[-1])]
        nb, q = self.buckets[-1], self.rows_per_req
        device = next(model.parameters()).device
        i64 = dict(dtype=torch.int64, device=device)
        self.pad = _padding(nb, q, pad_block, block_size, max_blocks_per_seq, pad_slot)
        self._pad_flat = self.pad.flat()
        self._host_flat = self._pad_flat.clone().pin_memory()
        self._flat = self._pad_flat.to(device)
        self.host = StepInts.views(self._host_flat, self.pad)
        self.ints = StepInts.views(self._flat, self.pad)
        self._tables_at = self._flat.numel() - self.pad.block_tables.numel()
        self.query_start_loc = torch.arange(nb + 1, **i64) * q       # every request has q rows
        self.sample_rows = torch.arange(nb, **i64)
        self.draft_rows = torch.full((nb,), num_spec_tokens, **i64)
        self.verify_rows = torch.arange(nb * q, **i64).view(nb, q)
        self.line_of_row = torch.arange(nb * q, **i64) // q
        if not self.is_first:
            h = model.arch.hidden_size
            self.inbound = torch.zeros(2, nb * q, h, dtype=next(model.parameters()).dtype, device=device)
        self.drafting = drafter is not None and self.is_last
        if self.is_last:        # verification's output, which the finish graph reads
            self.tokens = torch.zeros(nb, q, **i64)
            self.num_sampled = torch.ones(nb, **i64)
        self._buckets: dict[int, _Bucket] = {}
        self._live_layouts: dict[int, StepLayout] = {}
        self._live = 0
        self.replays = 0                      # steps served from a graph (tests and logs read it)
        self._uploaded = torch.cuda.Event()

    # -- capture --------------------------------------------------------------------------------

    def _layout(self, b: int) -> StepLayout:
        """The static buffers of bucket b, as a step layout (every request verifies K drafts)."""
        n, ints = b * self.rows_per_req, self.ints
        return StepLayout(num_spec_tokens=self.num_spec_tokens, input_ids=ints.input_ids[:n],
                          positions=ints.positions[:n], slot_mapping=ints.slot_mapping[:n],
                          query_start_loc=self.query_start_loc[:b + 1], seq_lens=ints.seq_lens[:b],
                          block_tables=ints.block_tables[:b], max_query_len=self.rows_per_req,
                          sample_rows=self.sample_rows[:b], verify_rows=self.verify_rows[:b],
                          num_drafts=ints.req_real_drafts[:b],    # (every request verifies)
                          draft_ids=ints.input_ids[:n].view(b, self.rows_per_req)[:, 1:],
                          mtp_input_ids=ints.mtp_input_ids[:n], state_slots=ints.state_slots[:b],
                          state_commit=ints.state_commit[:b], req_num_drafts=self.draft_rows[:b],
                          req_real_drafts=ints.req_real_drafts[:b],
                          carried=ints.carried[:b])

    def _forward(self, layout: StepLayout, ctx: ForwardContext) -> Forward:
        n = layout.input_ids.shape[0]
        if self.carry is not None and self.is_first:
            # before anything reads the rows: the carried lines' ids, positions, slots, lengths, commits
            self.fill(layout, self.carry, self.line_of_row[:n], self.block_size)
        if self.linear_states is not None:
            # built inside the capture: its tensors (which requests start fresh, ...) live in the
            # graph's pool and are recomputed from the static inputs at every replay
            ctx.linear = LinearMeta.build(layout.query_start_loc, layout.positions, layout.state_slots,
                                          layout.state_commit, layout.req_num_drafts, self.linear_states,
                                          LinearFlags.steady(self.num_spec_tokens, self.mixed_k))
        inbound = None if self.is_first else self.inbound[:, :n]
        hidden, residual = run_target(self.model, ctx, layout.input_ids, inbound)
        logits = None
        if self.is_last:      # all rows verify; greedily here (a step that samples redoes it eagerly)
            logits = self.model.compute_logits(hidden)
            b = layout.num_reqs
            tokens, num_sampled = verify_greedy(logits.view(b, self.rows_per_req, -1), layout.draft_ids,
                                                layout.num_drafts)
            self.tokens[:b].copy_(tokens)
            self.num_sampled[:b].copy_(num_sampled)
        return Forward(layout, None, hidden, residual, logits)

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket; `pool`: a graph memory pool shared with other graph sets (only one
        graph runs at a time, and each set's outputs stay allocated, so sharing is safe)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        for b in reversed(self.buckets):      # largest first: smaller ones reuse its memory
            layout = self._layout(b)
            attn = self.backend.capture_metadata(layout.query_start_loc, layout.seq_lens, layout.positions,
                                                 layout.block_tables, self.block_size, self.rows_per_req)
            ctx = ForwardContext(layout.positions, layout.slot_mapping, self.backend, attn, self.kv_caches)
            graph, out = capture_graph(pool, lambda: self._forward(layout, ctx))
            bucket = _Bucket(layout, graph, out, attn)
            if self.is_last:
                bucket.finish, bucket.data = capture_graph(pool, lambda: finish_step(
                    self.drafter if self.drafting else None, ctx, layout, out.hidden, self.tokens[:b],
                    self.num_sampled[:b], self.num_spec_tokens, b, self.carry))
            self._buckets[b] = bucket
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d batch sizes (up to %d, %d rows per request, K=%d) in %.1f s",
                    len(self.buckets), self.buckets[-1], self.rows_per_req, self.num_spec_tokens,
                    time.perf_counter() - start)

    def release(self) -> None:
        """Destroy every captured graph now, whoever still holds a reference to this object: a graph
        keeps the NCCL communicators whose collectives it captured alive (`Stage.close`)."""
        torch.cuda.synchronize()
        for bucket in self._buckets.values():
            bucket.forward.reset()
            if bucket.finish is not None:
                bucket.finish.reset()
        self._buckets.clear()

    # -- replay ---------------------------------------------------------------------------------

    def fits(self, layout: StepLayout, is_last: bool) -> bool:
        """Whether a host `layout` is a steady step these graphs can replay."""
        b, q = layout.num_reqs, self.rows_per_req
        if layout.num_spec_tokens != self.num_spec_tokens:
            return False
        if b == 0 or b > self.buckets[-1] or layout.input_ids.shape[0] != b * q:
            return False
        if layout.block_tables.shape[1] > self.ints.block_tables.shape[1] or layout.max_query_len != q:
            return False
        if is_last:   # every request samples, in a line of K draft rows (some may be dummies)
            return layout.num_samplers == b and bool((layout.req_num_drafts.numpy() == self.num_spec_tokens).all())
        return True

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _upload(self, layout: StepLayout, b: int) -> None:
        n_req, q = layout.num_reqs, self.rows_per_req
        self._uploaded.synchronize()          # the last step's upload has left the pinned buffer
        for name in StepInts.PER_TOKEN:
            host = getattr(self.host, name)
            host[:n_req * q].copy_(getattr(layout, name))
            host[n_req * q:b * q].copy_(getattr(self.pad, name)[n_req * q:b * q])
        for name in StepInts.PER_REQUEST:
            live = getattr(layout, name)
            host, pad = getattr(self.host, name), getattr(self.pad, name)
            # (state slots: only models with linear attention; carried: only async scheduling's)
            host[:n_req].copy_(live if live is not None else pad[:n_req])
            host[n_req:b].copy_(pad[n_req:b])
        self.host.block_tables[:n_req, :layout.block_tables.shape[1]].copy_(layout.block_tables)
        self.host.block_tables[n_req:b].copy_(self.pad.block_tables[n_req:b])
        end = self._tables_at + b * self.ints.block_tables.shape[1]
        self._flat[:end].copy_(self._host_flat[:end], non_blocking=True)
        self._uploaded.record()

    def _live_layout(self, b: int, n_req: int) -> StepLayout:
        """Bucket b's static layout cut to the live requests (what the verifier reads)."""
        if n_req not in self._live_layouts:
            full, n = self._buckets[b].layout, n_req * self.rows_per_req
            self._live_layouts[n_req] = StepLayout(
                num_spec_tokens=self.num_spec_tokens, input_ids=full.input_ids[:n], positions=full.positions[:n],
                slot_mapping=full.slot_mapping[:n], query_start_loc=full.query_start_loc[:n_req + 1],
                seq_lens=full.seq_lens[:n_req], block_tables=full.block_tables[:n_req],
                max_query_len=full.max_query_len, sample_rows=full.sample_rows[:n_req],
                verify_rows=full.verify_rows[:n_req], num_drafts=full.num_drafts[:n_req],
                draft_ids=full.draft_ids[:n_req], mtp_input_ids=full.mtp_input_ids[:n],
                req_num_drafts=full.req_num_drafts[:n_req])
        return self._live_layouts[n_req]

    def forward(self, layout: StepLayout, inbound: torch.Tensor | None) -> Forward:
        """Replay the forward graph for a steady host `layout`; the Forward of its live rows."""
        n_req = layout.num_reqs
        b, n = self._bucket(n_req), n_req * self.rows_per_req
        self._upload(layout, b)
        if inbound is not None:
            self.inbound[:, :n].copy_(inbound)
        bucket = self._buckets[b]
        self.backend.before_replay(bucket.attn)
        bucket.forward.replay()
        self.replays += 1
        self._live = n_req
        out = bucket.out
        return Forward(self._live_layout(b, n_req), None, out.hidden[:n],
                       None if out.residual is None else out.residual[:n],
                       None if out.logits is None else out.logits[:n])

    def finish(self, tokens: torch.Tensor | None = None, num_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """Replay the finish graph of the step just replayed (drafting, the result, the carry), from
        the forward graph's greedy verification or from `tokens` / `num_sampled` verified eagerly (a
        step that samples); the result data of its live requests (a view the next replay rewrites:
        the runtime copies it to the host first, in stream order)."""
        n_req = self._live
        if tokens is not None:
            self.tokens[:n_req].copy_(tokens)
            self.num_sampled[:n_req].copy_(num_sampled)
        bucket = self._buckets[self._bucket(n_req)]
        bucket.finish.replay()
        return bucket.data[:n_req]

    @torch.inference_mode()
    def time_replay(self, batch: int, iters: int = 50) -> dict[str, float]:
        """Median GPU milliseconds of one replay of each graph of `batch`'s bucket, on padding inputs
        (for benchmarks: the device's share of a step, without the host's)."""
        self._flat.copy_(self._pad_flat)
        bucket = self._buckets[self._bucket(batch)]
        out = {}
        for name, graph in (("forward", bucket.forward), ("finish", bucket.finish)):
            if graph is not None:
                out[f"{name}_gpu_ms"] = round(gpu_ms(graph.replay, iters), 3)
        return out


def capture_graph(pool, fn):
    """(graph, fn's outputs): fn run once eagerly (compiles its kernels, settles the allocator),
    then captured, both in `pdl_scope` so that the graph's kernels launch with PDL (`kernels/pdl.py`)
    and the variants it captures were compiled outside the capture. `pool`: a graph memory pool
    (None: the graph's own)."""
    with pdl_scope():
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = fn()
    return graph, out


def gpu_ms(fn, iters: int = 50) -> float:
    """Median GPU milliseconds of one call of `fn` (a graph's replay, a kernel launch)."""
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(calls: list, iters: int = 20) -> float:
    """GPU milliseconds of one of `calls` (closures over different buffers), as decode runs them:
    replayed from one CUDA graph that makes every call in turn, median over `iters` replays, divided
    by their number. Timed eagerly, a kernel that runs faster than the host launches it measures the
    launch (Triton's Python launch costs tens of microseconds); calls over distinct buffers whose
    total exceeds the L2 cache measure memory, not cache (benchmarks size them so)."""
    graph, _ = capture_graph(None, lambda: [call() for call in calls])    # as the engine's graphs run them
    ms = gpu_ms(graph.replay, iters) / len(calls)
    graph.reset()
    return ms


class GraphsByK:
    """A stage's graph sets, one per K its steps may use: with adaptive K every K in 0..the config's
    (a step with K = 0 replays a forward of one row per request and a draft graph that only writes
    the MTP KV); otherwise the config's K alone. The step's K (the plan's) picks the set."""

    def __init__(self, by_k: dict[int, CudaGraphs]):
        self.by_k = by_k
        self._replayed: CudaGraphs | None = None

    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        for k in sorted(self.by_k, reverse=True):     # the widest first: the others reuse its memory
            self.by_k[k].capture(pool)

    def release(self) -> None:
        for graphs in self.by_k.values():
            graphs.release()

    def fits(self, layout: StepLayout, is_last: bool) -> bool:
        graphs = self.by_k.get(layout.num_spec_tokens)
        return graphs is not None and graphs.fits(layout, is_last)

    def forward(self, layout: StepLayout, inbound: torch.Tensor | None) -> Forward:
        self._replayed = self.by_k[layout.num_spec_tokens]
        return self._replayed.forward(layout, inbound)

    def finish(self, tokens: torch.Tensor | None = None, num_sampled: torch.Tensor | None = None) -> torch.Tensor:
        """The finish graph of the set whose forward was just replayed."""
        return self._replayed.finish(tokens, num_sampled)

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.by_k.values())

    @property
    def buckets(self) -> list[int]:
        return next(iter(self.by_k.values())).buckets

    def time_replay(self, batch: int, k: int | None = None, iters: int = 50) -> dict[str, float]:
        """`CudaGraphs.time_replay` of the set for K = k (default: the largest)."""
        return self.by_k[max(self.by_k) if k is None else k].time_replay(batch, iters)
