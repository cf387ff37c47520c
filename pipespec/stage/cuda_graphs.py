"""CUDA graphs of a stage's steady steps: the step's forward and, on the last stage, its finish
(drafting, the result, the carry: `Stage.finish`), replayed over the stage's step-input buffers, one
pair per padded batch size (bucket) and per K a step may use (`GraphsByK`).

A steady step is one where every request runs exactly 1 + K query rows and, on the last stage, every
request samples with K draft rows (its real drafts, then dummy rows the scheduler pads a short line
with, which verification masks). Its shapes then depend on the batch size alone, so the stage's whole
forward (on the last stage with the LM head over every row, all of them verify rows, and greedy
verification) is captured once per bucket, and the finish is a second graph. A greedy step is then
an upload and two replays. Graphs captured when a step first needs them serve the rest: a step that
samples verifies in a graph per bucket and kind of sampling between the two; one that asks for
logprobs replays a graph per bucket and number of top logprobs, and one with penalties, biases or
bans a graph that processes its logits, per bucket and padded table sizes. Any other step (a grammar's
masks, a prefill) runs eagerly.

A bucket's graphs read the views `StepBuffers.padding_views` gave at capture; a step padded to the
bucket (`StepBuffers.write(plan, pad_to=b)`) is laid out at the same addresses, its requests first,
then padding requests that live in a spare KV block and state slot no request owns. The attention
metadata is built over those views at capture (`capture_metadata`; `before_replay` is the backend's
hook to refresh anything a replay cannot read there).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from pipespec.kernels import pdl_scope
from pipespec.model.attention import AttentionBackend, ForwardContext, KVCache
from pipespec.model.linear_state import LinearFlags, LinearMeta
from pipespec.plan import StepPlan
from pipespec.sampling import SamplingTensors, apply_penalties, logprob_columns, padded_logits_tables
from pipespec.stage.carry import Carry, carried_tokens
from pipespec.stage.step_input import StepBuffers, StepInput, verify
from pipespec.stage.target import run_target

logger = logging.getLogger(__name__)

_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


@dataclass
class Bucket:
    inp: StepInput                     # the padded views its graphs read
    forward: torch.cuda.CUDAGraph
    out: tuple                         # (hidden, residual, logits) the forward graph writes
    attn: object                       # the backend's metadata over the views
    finish: torch.cuda.CUDAGraph | None = None     # last stage: drafting, the result, the carry
    data: torch.Tensor | None = None
    # K = 0 with a drafter (adaptive K): the finish once speculation retired, without the drafter
    finish_plain: torch.cuda.CUDAGraph | None = None
    data_plain: torch.Tensor | None = None


class CudaGraphs:
    def __init__(self, model, drafter, backend: AttentionBackend, kv_caches: list[KVCache], buffers: StepBuffers,
                 block_size: int, num_spec_tokens: int, max_batch: int, finish: Callable,
                 linear_states: list | None = None, mixed_k: bool = False, carry: Carry | None = None):
        """`finish(ctx, inp, hidden, tokens, num_sampled, drafting)`: the last stage's end of a step,
        captured as the finish graph. `mixed_k`: steps of other K run between this set's (adaptive K), so a K = 0
        step may follow a verify step and must adopt its candidate linear-attention state (a masked
        commit). `carry`: async scheduling's buffers, which the forward graph reads first."""
        self.model, self.drafter, self.backend, self.kv_caches = model, drafter, backend, kv_caches
        self.buffers, self.block_size, self.finish_fn = buffers, block_size, finish
        self.carry, self.mixed_k, self.linear_states = carry, mixed_k, linear_states
        self.num_spec_tokens = num_spec_tokens
        self.is_first, self.is_last = model.model.is_first, model.model.is_last
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [min(max_batch, _BUCKETS[-1])]
        nb, q = self.buckets[-1], num_spec_tokens + 1
        param = next(model.parameters())
        if not self.is_first:
            self.inbound = torch.zeros(2, nb * q, model.arch.hidden_size, dtype=param.dtype, device=param.device)
        if self.is_last:        # verification's output, which the finish graph reads
            self.tokens = torch.zeros(nb, q, dtype=torch.int64, device=param.device)
            self.num_sampled = torch.ones(nb, dtype=torch.int64, device=param.device)
        self._buckets: dict[int, Bucket] = {}
        # (bucket, num_logprobs) -> (graph, packed logprobs of every row): captured at first use
        self._logprob_graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # (bucket, padded table sizes, carried) -> (graph, its input tables); per bucket the float32
        # [b, 1 + K, V] buffer they write the processed logits into
        self._logits_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self._processed: dict[int, torch.Tensor] = {}
        # (bucket, all_greedy, needs_sort, from processed logits) -> (graph, its static sampling tensors)
        self._verify_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, SamplingTensors]] = {}
        self._pool = None
        self._live = 0
        self.replays = 0                      # steps served from a graph (tests and logs read it)
        self.logprob_replays = 0
        self.logits_replays = 0
        self.verify_replays = 0

    # -- capture --------------------------------------------------------------------------------

    def _forward(self, inp: StepInput, ctx: ForwardContext) -> tuple:
        if self.carry is not None and self.is_first:
            self.carry.fill(inp, self.block_size)     # before anything reads the rows
        if self.linear_states is not None:
            # built inside the capture: its tensors (which requests start fresh, ...) live in the
            # graph's pool and are recomputed from the views at every replay
            ctx.linear = LinearMeta.build(inp.query_start_loc, inp.positions, inp.state_slots, inp.state_commit,
                                          inp.num_draft_rows, self.linear_states,
                                          LinearFlags.steady(self.num_spec_tokens, self.mixed_k))
        inbound = None if self.is_first else self.inbound[:, :inp.input_ids.shape[0]]
        hidden, residual = run_target(self.model, ctx, inp.input_ids, inbound)
        logits = None
        if self.is_last:      # all rows verify; greedily here (a step that samples verifies again eagerly)
            logits = self.model.compute_logits(hidden)
            b = inp.num_reqs
            tokens, num_sampled = verify(logits.view(b, self.num_spec_tokens + 1, -1), inp, None)
            self.tokens[:b].copy_(tokens)
            self.num_sampled[:b].copy_(num_sampled)
        return hidden, residual, logits

    @torch.inference_mode()
    def capture(self, pool=None) -> None:
        """Capture every bucket; `pool`: a graph memory pool shared with other graph sets (only one
        graph runs at a time, and each set's outputs stay allocated, so sharing is safe)."""
        start = time.perf_counter()
        pool = self._pool = torch.cuda.graph_pool_handle() if pool is None else pool
        q = self.num_spec_tokens + 1
        for b in reversed(self.buckets):      # largest first: smaller ones reuse its memory
            inp = self.buffers.padding_views(b, self.num_spec_tokens)
            attn = self.backend.capture_metadata(inp.query_start_loc, inp.seq_lens, inp.positions,
                                                 inp.block_tables, self.block_size, q)
            ctx = ForwardContext(inp.positions, inp.slot_mapping, self.backend, attn, self.kv_caches)
            graph, out = capture_graph(pool, lambda: self._forward(inp, ctx))
            bucket = Bucket(inp, graph, out, attn)
            if self.is_last:
                drafting = self.drafter is not None
                bucket.finish, bucket.data = capture_graph(pool, lambda: self.finish_fn(
                    ctx, inp, out[0], self.tokens[:b], self.num_sampled[:b], drafting))
                if drafting and self.num_spec_tokens == 0 and self.mixed_k:
                    bucket.finish_plain, bucket.data_plain = capture_graph(pool, lambda: self.finish_fn(
                        ctx, inp, out[0], self.tokens[:b], self.num_sampled[:b], False))
            self._buckets[b] = bucket
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d batch sizes (up to %d, K=%d) in %.1f s", len(self.buckets),
                    self.buckets[-1], self.num_spec_tokens, time.perf_counter() - start)

    def release(self) -> None:
        """Destroy every captured graph now, whoever still holds a reference to this object: a graph
        keeps the NCCL communicators whose collectives it captured alive (`Stage.close`)."""
        torch.cuda.synchronize()
        for bucket in self._buckets.values():
            bucket.forward.reset()
            if bucket.finish is not None:
                bucket.finish.reset()
        for graph, _ in (*self._logprob_graphs.values(), *self._logits_graphs.values(), *self._verify_graphs.values()):
            graph.reset()
        self._buckets.clear()
        self._logprob_graphs.clear()
        self._logits_graphs.clear()
        self._verify_graphs.clear()
        self._processed.clear()

    # -- replay ---------------------------------------------------------------------------------

    def bucket_for(self, plan: StepPlan) -> int | None:
        """The bucket a host `plan` replays in, or None when it is not a steady step of this K."""
        b, q = plan.num_reqs, self.num_spec_tokens + 1
        if plan.num_spec_tokens != self.num_spec_tokens or b == 0 or b > self.buckets[-1]:
            return None
        if plan.num_tokens != b * q or plan.block_tables.shape[1] > self.buffers.max_blocks:
            return None
        if not bool((plan.query_lens().numpy() == q).all()):
            return None
        # the last stage: every request samples, in a line of K draft rows (some may be dummies)
        if self.is_last and (plan.sampling_reqs.shape[0] != b or bool((plan.num_draft_rows.numpy() != self.num_spec_tokens).any())):
            return None
        return self._bucket_size(b)

    def forward(self, bucket: int, inp: StepInput, inbound: torch.Tensor | None) -> tuple:
        """Replay bucket's forward graph for `inp` (written padded to it); (hidden, residual, logits)
        of its live rows."""
        n = inp.input_ids.shape[0]
        if inbound is not None:
            self.inbound[:, :n].copy_(inbound)
        b = self._buckets[bucket]
        self.backend.before_replay(b.attn)
        b.forward.replay()
        self.replays += 1
        self._live = inp.num_reqs
        return tuple(None if t is None else t[:n] for t in b.out)

    def finish(self, tokens: torch.Tensor | None = None, num_sampled: torch.Tensor | None = None,
               drafting: bool = True) -> torch.Tensor:
        """Replay the finish graph of the step just replayed, from the forward graph's greedy
        verification or from `tokens` / `num_sampled` verified eagerly (a step that samples); the
        result data of its live requests (a view the next replay rewrites: the runtime copies it to
        the host first, in stream order). `drafting` False: the drafter retired (adaptive K)."""
        n_req = self._live
        if tokens is not None:
            self.tokens[:n_req].copy_(tokens)
            self.num_sampled[:n_req].copy_(num_sampled)
        bucket = self._buckets[self._bucket_size(n_req)]
        if not drafting and bucket.finish_plain is not None:
            bucket.finish_plain.replay()
            return bucket.data_plain[:n_req]
        bucket.finish.replay()
        return bucket.data[:n_req]

    def verify(self, sampling: SamplingTensors, processed: bool) -> None:
        """Verify the step just replayed with its own sampling parameters (`step_input.verify`:
        keyed noise, no host read), from the forward graph's logits or, `processed`, from what
        `processed_logits` just wrote; the tokens and num_sampled go where the finish graph reads
        them. A graph per bucket, kind of sampling (greedy, sorting for top-k / top-p or not) and
        source, captured when a step first needs it, over static sampling tensors padded to the
        bucket (`SamplingTensors.padded`): eagerly, sampled verification takes dozens of launches
        and five uploads a step."""
        n_req, q = self._live, self.num_spec_tokens + 1
        b = self._bucket_size(n_req)
        key = (b, sampling.all_greedy, sampling.needs_sort, processed)
        host = sampling.padded(b)
        entry = self._verify_graphs.get(key)
        if entry is None:
            bucket = self._buckets[b]
            logits = self._processed[b] if processed else bucket.out[2].view(b, q, -1)
            static = SamplingTensors(*(t.to(logits.device) for t in host.tensors()), sampling.needs_sort,
                                     sampling.all_greedy)

            def run():
                tokens, num_sampled = verify(logits, bucket.inp, static)
                self.tokens[:b].copy_(tokens)
                self.num_sampled[:b].copy_(num_sampled)
            entry = self._verify_graphs[key] = (capture_graph(self._pool, run)[0], static)
            logger.debug("Captured the verification graph of batch size %d, %s", b, key[1:])
        graph, static = entry
        for dst, src in zip(static.tensors(), host.tensors()):
            dst.copy_(src.pin_memory(), non_blocking=True)
        graph.replay()
        self.verify_replays += 1

    def _bucket_size(self, batch: int) -> int:
        """The smallest bucket that holds `batch` requests."""
        return next(b for b in self.buckets if b >= batch)

    def logprobs(self, num_logprobs: int) -> torch.Tensor:
        """The packed logprobs (`sampling.logprob_columns`) of the step just replayed and finished:
        every request's verify rows, from the forward graph's logits and the tokens its verification
        gave (in a replayed step every request samples, in order). A graph per bucket and
        `num_logprobs`, captured when a step first asks for it: eagerly the columns take ~20 launches
        (logsumexp and topk are several kernels each), a host cost that would bound every step.
        Returns [live requests, (1 + K) * logprob_width(N)], a view the next replay rewrites."""
        n_req = self._live
        b = self._bucket_size(n_req)
        entry = self._logprob_graphs.get((b, num_logprobs))
        if entry is None:
            logits, tokens = self._buckets[b].out[2], self.tokens[:b]
            entry = self._logprob_graphs[(b, num_logprobs)] = capture_graph(
                self._pool, lambda: logprob_columns(logits.view(b, self.num_spec_tokens + 1, -1), tokens, num_logprobs))
            logger.debug("Captured the logprobs graph of batch size %d, %d top logprobs", b, num_logprobs)
        graph, out = entry
        graph.replay()
        self.logprob_replays += 1
        return out[:n_req]

    def processed_logits(self, plan: StepPlan, carried: bool) -> torch.Tensor:
        """The logits of the step just replayed with the plan's penalties, biases and bans applied
        (`sampling.apply_penalties`), [live requests, 1 + K, V] float32, a view the next replay
        rewrites. `carried`: the tokens the carried lines' step in flight sampled count too.

        A graph per bucket, table sizes (padded to powers of two, `padded_logits_tables`) and
        `carried`, captured when a step first needs it: eagerly the processing takes ~70 launches.
        Lazily captured graphs share the pool with the others and run in another order than they
        were captured, which is safe because each one's output is read before another replays
        (these write into a buffer of their own, outside the pool)."""
        n_req, q = self._live, self.num_spec_tokens + 1
        b = self._bucket_size(n_req)
        rows = lambda t: 0 if t is None or not t.shape[0] else max(16, 1 << (t.shape[0] - 1).bit_length())  # noqa: E731
        key = (b, rows(plan.penalty_tokens) if plan.penalties is not None else -1, rows(plan.bias_entries), carried)
        tables = padded_logits_tables(plan.penalties, plan.penalty_tokens, plan.bias_entries, plan.bias_values,
                                      b, max(key[1], 0), key[2])
        tables = [None if t is None or not t.shape[0] else t for t in tables]
        entry = self._logits_graphs.get(key)
        if entry is None:
            bucket = self._buckets[b]
            logits = bucket.out[2].view(b, q, -1)
            if b not in self._processed:
                self._processed[b] = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            inputs = tuple(None if t is None else torch.empty_like(t, device=logits.device) for t in tables)
            inp = bucket.inp

            def process():
                extra = carried_tokens(inp, self.carry) if carried else None
                apply_penalties(logits, inp.draft_ids, inp.line_drafts, *inputs, carried=extra, out=self._processed[b])
            for static, t in zip(inputs, tables):      # the capture's warm-up run reads them
                if static is not None:
                    static.copy_(t)
            entry = self._logits_graphs[key] = (capture_graph(self._pool, process)[0], inputs)
            logger.debug("Captured the logits-processing graph of batch size %d, tables %s", b, key[1:])
        graph, inputs = entry
        for static, t in zip(inputs, tables):
            if static is not None:
                static.copy_(t.pin_memory(), non_blocking=True)
        graph.replay()
        self.logits_replays += 1
        return self._processed[b][:n_req]

    def bucket(self, batch: int) -> Bucket:
        """The captured bucket a batch of `batch` requests replays (benchmarks time its graphs)."""
        return self._buckets[self._bucket_size(batch)]


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

    def bucket_for(self, plan: StepPlan) -> int | None:
        graphs = self.by_k.get(plan.num_spec_tokens)
        return None if graphs is None else graphs.bucket_for(plan)

    def forward(self, bucket: int, inp: StepInput, inbound: torch.Tensor | None) -> tuple:
        self._replayed = self.by_k[inp.num_spec_tokens]
        return self._replayed.forward(bucket, inp, inbound)

    def finish(self, tokens: torch.Tensor | None = None, num_sampled: torch.Tensor | None = None,
               drafting: bool = True) -> torch.Tensor:
        """The finish graph of the set whose forward was just replayed."""
        return self._replayed.finish(tokens, num_sampled, drafting)

    def verify(self, sampling: SamplingTensors, processed: bool) -> None:
        """The verification graph of the set whose forward was just replayed."""
        self._replayed.verify(sampling, processed)

    def logprobs(self, num_logprobs: int) -> torch.Tensor:
        """The logprobs graph of the set whose step was just replayed and finished."""
        return self._replayed.logprobs(num_logprobs)

    def processed_logits(self, plan: StepPlan, carried: bool) -> torch.Tensor:
        """The logits-processing graph of the set whose forward was just replayed."""
        return self._replayed.processed_logits(plan, carried)

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.by_k.values())

    @property
    def logprob_replays(self) -> int:
        return sum(g.logprob_replays for g in self.by_k.values())

    @property
    def logits_replays(self) -> int:
        return sum(g.logits_replays for g in self.by_k.values())

    @property
    def verify_replays(self) -> int:
        return sum(g.verify_replays for g in self.by_k.values())

    @property
    def buckets(self) -> list[int]:
        return next(iter(self.by_k.values())).buckets
