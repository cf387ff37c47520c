"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each call to `schedule` picks one micro-batch: running requests first -- those decoding (one row
plus drafts each), then those part-way through their prompt, each group oldest first -- then waiting
ones while budget, sequence slots and KV blocks last. When blocks run out, the newest running request
not yet picked is preempted: its blocks are freed and it goes back to the front of the queue to be
recomputed later (its seeded samples do not change).

Prefix caching (`enable_prefix_caching`): once a full block's KV is computed and final, the block is
registered in the allocator's cache under an exact key (its tokens chained to its parent block's);
when its requests let it go it stays cached, evictable least recently used first. A request admitted
from the queue (new or preempted) first takes the longest cached chain of its tokens' full blocks and
is scheduled from the first token after it, so the plan simply starts later: stages keep reading
the cache through the block ids the plan names (I1, I2). Only full blocks that no step will write
again are shared, so no shared block is ever written: the tokens after a hit are computed in the
request's own blocks, and the last token of the prompt always is (its logits are needed), never
from a cached block. Preemption, abort and finish drop references; a block stays while any
request holds it.

Linear-attention states (Qwen3.5/3.6, Qwen3-Next: `num_state_snapshots`): a prefix's KV blocks are
not enough there, its Gated DeltaNet layers need their conv and recurrent states at the prefix's end,
one state per request, not per block. So the scheduler keeps snapshots of them at block-aligned
prompt positions, in slots of their own with their own LRU (an allocator like the KV blocks', keyed
by the cache id of the KV block ending at the snapshot, which names the exact prefix). A hit then
needs both: the longest cached chain of full blocks whose last block has a snapshot. The plan names,
per request, a snapshot to restore into its state slot before the step and one to save its slot
into after it (`StepPlan.state_snapshots`); each stage copies its own layers' states. A snapshot is
taken where a prefill chunk ends, so chunks are cut at the request's snapshot points
(`_snapshot_cut`): the state after a chunk is the state at its end, exactly, and nowhere else inside
it. Two points per prompt, chosen when it is admitted (`_restorable`): the last block boundary before
its last token (a repeated prompt, the next turn of a conversation, n > 1 siblings restore it); and,
where the KV cache holds the prompt's blocks further than any snapshot, the end of that chain: an
earlier prompt went on differently from there (a shared system prompt), so later ones sharing the
same start restore it. Snapshots every N blocks would cost a snapshot per N blocks of every long
prompt (61 MiB each on Qwen3.5-35B-A3B, the KV of ~3,000 tokens) and still lose up to N blocks;
these two points sit where prompts share. A snapshot slot is handed out again only after the step
that restores it was planned, and every stage runs steps in plan order with a step's restores
before its saves, so no restore reads a snapshot rewritten after it was planned; no reference is
held for it. The MTP layer of these families is a gated full-attention block
(`model/mtp/qwen3_next.py`: `linear=False`), so its KV is reused by block like the target's, keyed
with the token after the block (`_key_extra`), and it has no state to snapshot. Cutting a prefill
chunk at a snapshot point is the simplest correct scheme: a stage only ever holds the state after a
chunk's last row, so saving inside a chunk would need a second state per line written mid-kernel;
the cost is at most two extra chunk boundaries per prompt.

No head-of-line blocking: while the engine holds other requests, one request's prefill chunk takes at
most `long_prefill_token_threshold` tokens of a step (a quarter of the budget unless set), so a long
prompt shares every step with the decodes and the short prompts that arrive after it instead of
filling the steps alone; alone in the engine it takes the whole budget.

With P pipeline stages up to P micro-batches are in flight, and a request is in at most one of them
(its next plan needs its last result). So that every stage has work, a micro-batch then takes at
most ceil(n / P) requests, n being those that could run now (running plus admissible waiting).

Async scheduling (one stage) is the exception: a request in the one step in flight may be scheduled
again before that step returns. Its next rows are then either the rest of its prompt, known here, or
the token that step samples and the drafts it proposes (`_continues`), which the plan marks as
carried (`StepPlan.carried`) and the stage fills in from its previous result (`stage/carry.py`).
Positions and KV slots follow from the counts the driver knows and move on, on the device, by the
drafts accepted, so only token ids travel late.
"""
from __future__ import annotations

import logging
from array import array
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from pipespec.config import SchedulerConfig
from pipespec.engine.block_allocator import ROOT, BlockAllocator
from pipespec.engine.host_tensors import float32_tensor, int64_tensor
from pipespec.engine.logits_inputs import logits_inputs
from pipespec.engine.request import Request, RequestStatus
from pipespec.engine.structured import grammar_inputs
from pipespec.plan import StepPlan, StepResult, draft_chain_overrun
from pipespec.sampling import SamplingTensors

logger = logging.getLogger(__name__)


class _Line(NamedTuple):
    """One picked request's part of a step: its query rows, the real drafts it verifies, its draft
    rows (real, then dummy: `_pad_lines`), and whether it samples."""
    req: Request
    rows: int
    num_drafts: int
    num_draft_rows: int
    samples: bool


@dataclass
class ScheduledBatch:
    plan: StepPlan
    requests: list[Request]
    num_new_tokens: list[int]     # query rows of each request, draft rows included
    num_drafts: list[int]         # real drafts each request verifies
    num_draft_rows: list[int]     # its draft rows: the real drafts, then dummy ones (`_pad_lines`)
    samples: list[bool]           # whether each request samples this step
    k_settling: bool = False      # K changed within the steps its time overlaps (`Scheduler.k_settle`)
    prompt_logprob_rows: list[int] | None = None    # rows each line scores prompt tokens at (None: none)
    submitted_at: float = 0.0     # when the driver handed it to the executor (adaptive K's step cost)
    # (request, snapshot slot, position) of each linear-attention state snapshot the step saves
    snapshot_saves: list[tuple[Request, int, int]] | None = None

    @property
    def steady(self) -> bool:
        """Every request decodes verifying exactly the step's K real drafts, and K did not just
        change: the step adaptive K costs. The first steps at a new K are a transition whose time is
        not K's: under async scheduling a step after K = 0 (padded, `_pad_lines`) overlaps the one
        before it, and the first K = 0 step after drafts does not (its predecessor's result was awaited)."""
        k = self.plan.num_spec_tokens
        return not self.k_settling and all(n == k + 1 and d == k for n, d in zip(self.num_new_tokens, self.num_drafts))


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_size: int, num_blocks: int, max_model_len: int,
                 num_micro_batches: int = 1, num_spec_tokens: int = 0,
                 choose_k: Callable[[int], int] | None = None, async_scheduling: bool = False,
                 enable_prefix_caching: bool = False, drafting: Callable[[], bool] | None = None,
                 num_state_snapshots: int = 0):
        """`choose_k(num_reqs)`: the K of a step of that many requests (adaptive K); None: always
        `num_spec_tokens`, the config's K (which also sizes the KV room drafts need). `drafting()`:
        False once adaptive K retired speculation (`StepPlan.drafting`); None: always True.
        `async_scheduling`: a request of the step in flight may be scheduled again (`_continues`).
        `enable_prefix_caching`: reuse cached full KV blocks of a prompt's prefix (module docstring).
        `num_state_snapshots`: a model with linear-attention layers, whose prefix cache keeps that many
        snapshots of their states (module docstring); 0: a model without such layers."""
        if async_scheduling and num_micro_batches > 1:
            raise ValueError("async scheduling needs one micro-batch in flight")
        self.async_scheduling = async_scheduling
        self.num_carried_rows = 0          # rows whose input token was carried (async scheduling)
        self._last_k = 0                   # K of the last step scheduled
        self._k_age = 0                    # steps scheduled at that K before it
        # steps after a change of K whose time still shows the change: a step's time is the interval
        # between its result and the previous one, which the steps in flight with it share (with
        # async scheduling the step before it, planned at the old K; with PP the other micro-batches)
        self.k_settle = num_micro_batches + async_scheduling
        self.config = config
        self.num_spec_tokens = num_spec_tokens
        self.choose_k = choose_k
        self.drafting = drafting
        self.num_micro_batches = num_micro_batches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.allocator = BlockAllocator(num_blocks, enable_caching=enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self._extra = self._key_extra(num_spec_tokens)
        self.prefix_cache_queries = 0      # tokens of the requests admitted with a cache lookup
        self.prefix_cache_hits = 0         # of them, tokens whose KV came from the cache
        # one linear-attention state slot per running request (models with Gated DeltaNet layers;
        # cheap bookkeeping otherwise), allocated and freed beside its KV blocks
        self.state_slots = BlockAllocator(config.max_num_seqs)
        self.state_snapshots = None
        if enable_prefix_caching and num_state_snapshots:
            self.state_snapshots = BlockAllocator(num_state_snapshots, enable_caching=True)
        self.num_snapshot_restores = 0     # requests admitted restoring a snapshot
        self.num_snapshot_saves = 0        # snapshots registered (a new prefix's)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._step_id = 0

    # -- request lifecycle ------------------------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Mark finished and free its blocks (a request still in flight is freed when it returns)."""
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if not req.in_flight:
            self._release(req)

    def _release(self, req: Request) -> None:
        if self.enable_prefix_caching:
            self._cache_blocks(req)
        self.allocator.free(reversed(req.block_ids))      # (its tail is evicted before its head)
        del req.block_ids[:]
        req.num_cached_blocks, req.cache_parent = 0, ROOT
        if req.state_slot is not None:
            self.state_slots.free([req.state_slot])
            req.state_slot = None
        req.state_commit = -1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling -------------------------------------------------------------------------

    def _blocks_needed(self, req: Request, num_tokens: int) -> int:
        return max(-(-num_tokens // self.block_size) - len(req.block_ids), 0)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.preempted = True
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1
        logger.debug("preempted %s (KV cache full)", req.request_id)

    def _micro_batch_cap(self) -> int:
        """Most requests one micro-batch may take, so the in-flight micro-batches share the work."""
        if self.num_micro_batches <= 1:
            return self.config.max_num_seqs
        admissible = min(len(self.waiting), max(self.config.max_num_seqs - len(self.running), 0))
        return max(1, -(-(len(self.running) + admissible) // self.num_micro_batches))

    def schedule(self) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        cap = self._micro_batch_cap()
        shared = len(self.running) + len(self.waiting) > 1
        chunk_limit = self.config.prefill_chunk_limit if shared and self.config.enable_chunked_prefill else 0
        picked: list[tuple[Request, int, int]] = []
        snapshots: dict[Request, tuple[int, int]] = {}      # (restore, save) of the lines that have either
        saves: list[tuple[Request, int, int]] = []

        def take(req: Request, n: int, d: int, restore: int = -1, save: bool = False) -> None:
            nonlocal budget
            req.in_flight += 1             # from now on no preemption picks it as a victim
            if restore >= 0 or save:
                slot = self.state_snapshots.allocate(1)[0] if save else -1
                snapshots[req] = (restore, slot)
                if save:
                    saves.append((req, slot, req.num_scheduled_tokens + n))
            picked.append((req, n + d, d))
            budget -= n + d

        ready = [r for r in self.running if not r.in_flight or self._continues(r)]
        if self.async_scheduling and any(r.in_flight and r.num_pending_samples and self._waits_for_result(r)
                                         for r in self.running):
            # requests that run step for step with their results: those not in flight wait for the
            # ones that are, to share their next step, instead of alternating for good in two half
            # batches (a prefill split over two steps did that: twice the steps, RESULTS.md)
            ready = [r for r in ready if r.in_flight or not self._waits_for_result(r) or self._prefilling(r)]
        ready.sort(key=self._prefilling)   # stable: decodes first
        for req in ready:
            if budget <= 0 or len(picked) >= cap:
                break
            if req.status is not RequestStatus.RUNNING:
                continue                   # preempted to make room for one picked before it
            n = self._chunk(req, budget, chunk_limit)
            save = False
            if req.snapshot_points:
                n, save = self._snapshot_cut(req.num_scheduled_tokens, n, req.snapshot_points)
            d = self._num_drafts(req, budget - n)
            need = self._blocks_needed(req, self._tokens_with_draft_room(req, n + d))
            if req.in_flight and not self.allocator.can_allocate(need):
                continue                   # a step ahead is not worth a preemption: next time
            while not self.allocator.can_allocate(need):
                victim = next(r for r in reversed(self.running) if not r.in_flight)
                self._preempt(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue                   # it preempted itself
            if need:
                req.block_ids.extend(self.allocator.allocate(need))
            take(req, n, d, save=save)

        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and len(picked) < cap):
            req = self.waiting[0]
            if self._waits_for_leader(req):
                break                      # its sibling's prompt blocks are computed first, then shared
            # (a waiting request is not in flight, and holds no blocks: none computed)
            # (prompt logprobs still to score need the prompt's logits: its rows are computed)
            lookup = self.enable_prefix_caching and (req.prompt_logprobs is None
                                                     or req.num_prompt_logprob_rows >= req.num_prompt_tokens)
            hits, parent = self._cached_prefix(req) if lookup else ((), ROOT)
            restore, points, save = -1, (), False
            if self.state_snapshots is not None:
                hits, parent, restore, points = self._restorable(req, hits)
            if hits:
                req.block_ids.extend(hits)
                req.num_computed_tokens = len(hits) * self.block_size
            n = req.num_tokens - req.num_computed_tokens
            n = n if n <= budget or self.config.enable_chunked_prefill else 0
            if n:
                n = self._chunk(req, budget, chunk_limit)
                if points:
                    n, save = self._snapshot_cut(req.num_computed_tokens, n, points)
                need = self._blocks_needed(req, self._tokens_with_draft_room(req, n))
                # a preempted request comes back only once all the tokens it had fit again: let in
                # for its next chunk alone, two requests that overfilled the cache together took
                # turns for good, each resuming from its cached prefix just far enough to need the
                # blocks the other held, and preempting it (hybrids at PP = 2, RESULTS.md)
                room = need
                if req.preempted:
                    rest = req.num_tokens - req.num_computed_tokens
                    room = self._blocks_needed(req, self._tokens_with_draft_room(req, rest))
                # (taking a cached block nobody holds uses up room too)
                room += self.allocator.num_evictable(hits) if hits else 0
            if not n or not self.allocator.can_allocate(room) or not self.state_slots.can_allocate(1):
                if hits:
                    del req.block_ids[:]
                    req.num_computed_tokens = 0
                break                      # (a finished request still in flight holds its slot)
            self.waiting.popleft()
            if self.enable_prefix_caching:
                self.allocator.take(hits)
                req.num_cached_blocks, req.cache_parent = len(hits), parent
                self.prefix_cache_queries += req.num_tokens
                self.prefix_cache_hits += req.num_computed_tokens
                if restore >= 0:               # (most recently used now)
                    self.state_snapshots.take([restore])
                    self.state_snapshots.free([restore])
                    self.num_snapshot_restores += 1
            req.snapshot_points = points
            req.block_ids.extend(self.allocator.allocate(need))
            req.state_slot = self.state_slots.allocate(1)[0]
            req.state_commit = -1
            req.status = RequestStatus.RUNNING
            req.draft_ids = []          # (re)starting from a prefill: old drafts are stale
            self.running.append(req)
            take(req, n, 0, restore, save)

        if not picked:
            return None
        k = self.num_spec_tokens if self.choose_k is None else self.choose_k(len(picked))
        # a request holds the drafts of its last step's K: verify at most this step's K of them
        lines = self._pad_lines([(r, n - d + min(d, k), min(d, k)) for r, n, d in picked], k)
        self._step_id += 1
        self._k_age = self._k_age + 1 if k == self._last_k else 0
        self._last_k = k
        plan, prompt_rows = self._build_plan(lines, k, snapshots)
        for row, line in enumerate(lines):
            line.req.num_pending_tokens += line.rows - line.num_draft_rows
            line.req.num_pending_samples += line.samples
            line.req.carry_row = row
            # until its result says which: a line with draft rows leaves a candidate state to commit
            # (a plan continuing it names one; the device puts the right one in, `carry_in`)
            line.req.state_commit = 0 if line.num_draft_rows else -1
        requests, rows, drafts, draft_rows, samples = map(list, zip(*lines))
        settling = self._k_age < self.k_settle
        return ScheduledBatch(plan, requests, rows, drafts, draft_rows, samples, settling, prompt_rows,
                              snapshot_saves=saves or None)

    def _waits_for_leader(self, req: Request) -> bool:
        """n > 1: a sibling waits while the first one is computing the prompt's full blocks, which it
        then takes from the prefix cache instead of computing them again."""
        leader = req.prefix_leader
        if leader is None:
            return False
        shared = (req.num_prompt_tokens - 1) // self.block_size * self.block_size
        if leader.finished or shared == 0 or leader.num_computed_tokens >= shared:
            req.prefix_leader = None       # (admitted from now on like any request)
            return False
        return True

    def _pad_lines(self, picked: list[tuple[Request, int, int]], k: int) -> list[_Line]:
        """The lines of the picked (request, rows, drafts). A decoding request with fewer drafts than
        K (the step after a smaller K, near max_model_len) gets dummy draft rows up to K, within the
        step's budget: verification masks them (`StepPlan.num_drafts` counts only the real ones), they write KV where rejected
        drafts would, and the step keeps the shape a CUDA graph replays."""
        spare = self.config.max_num_batched_tokens - sum(n for _, n, _ in picked)
        lines = []
        for req, n, d in picked:
            samples = req.num_scheduled_tokens + n - d == req.num_expected_tokens
            pad = k - d if k and n - d == 1 and samples else 0
            if pad > spare:
                pad = 0
            spare -= pad
            lines.append(_Line(req, n + pad, d, d + pad, samples))
        return lines

    def _continues(self, req: Request) -> bool:
        """Async scheduling: whether `req`, in the step in flight, runs again in the next one. Its
        next rows are the rest of its prompt, or the token that step samples and the drafts it
        proposes (`_carried_drafts`), at positions that move on by the drafts it accepts: all on the
        device (`carry_in`). Never when the host's count of its tokens (that step accepting no draft)
        already reaches a length limit, nor when its drafts could cross max_model_len (a longer end,
        or one by a stop or EOS token, costs the rows planned past it, dropped on return). (The step
        in flight is always the last one scheduled.)"""
        if not self.async_scheduling or req.in_flight != 1:
            return False
        # bans that vary by row (min_tokens, multi-token bad words) and grammar masks are worked out
        # here from the tokens before each row, which include those the step in flight samples;
        # penalties and static biases are not: the stage counts those tokens (`carried_tokens`)
        if req.num_pending_samples and self._waits_for_result(req):
            return False
        n = req.num_expected_tokens
        return not req.num_pending_samples or (n - req.num_prompt_tokens < req.max_tokens
                                               and n + self._last_k + self.num_spec_tokens < self.max_model_len)

    @property
    def num_steps(self) -> int:
        """Steps scheduled so far."""
        return self._step_id

    @staticmethod
    def _prefilling(req: Request) -> bool:
        """Whether more of its prompt than its last token is left to schedule."""
        return req.num_scheduled_tokens < req.num_expected_tokens - 1

    @staticmethod
    def _waits_for_result(req: Request) -> bool:
        """Whether the rows after a sampled token need that token on the host: bans that vary by row
        (min_tokens, multi-token bad words) and grammar masks."""
        return bool(req.row_bans) or req.grammar is not None

    def _carried_drafts(self, req: Request) -> int:
        """Drafts the step in flight proposes for `req` when it samples there (its K): the drafts a
        continued line verifies, and the most positions that line moves on by."""
        return self._last_k if req.in_flight and req.num_pending_samples else 0

    @staticmethod
    def _chunk(req: Request, budget: int, limit: int) -> int:
        """Tokens of `req` to compute this step: what is left, within the budget and the chunk limit
        (0: none). A decode is one token, so the limit only ever shortens prefill chunks."""
        n = min(req.num_expected_tokens - req.num_scheduled_tokens, budget)
        return min(n, limit) if limit else n

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Drafts verified this step, within budget and max_model_len: in steady decode the ones the
        request holds; continued, the ones its step in flight proposes (on the device)."""
        if req.in_flight:
            held, end = self._carried_drafts(req), req.num_expected_tokens + self._carried_drafts(req)
        elif req.draft_ids and req.num_computed_tokens == req.num_tokens - 1:
            held, end = len(req.draft_ids), req.num_tokens
        else:
            return 0
        return max(min(held, budget, self.max_model_len - end), 0)

    def _tokens_with_draft_room(self, req: Request, n: int) -> int:
        """KV room for a step of n rows: a sampling line may hold up to K draft rows, real or dummy
        (`_pad_lines`), and the MTP chain after it writes KV up to K - 1 positions past them."""
        end = req.num_scheduled_tokens + n
        if end < req.num_expected_tokens:
            return end
        # (a continued line starts up to its carried drafts later: the ones its step in flight accepts)
        return (req.num_expected_tokens + self._carried_drafts(req) + self.num_spec_tokens
                + draft_chain_overrun(self.num_spec_tokens))

    def _build_plan(self, lines: list[_Line], k: int,
                    snapshots: dict[Request, tuple[int, int]]) -> tuple[StepPlan, list[int] | None]:
        """The plan, and the prompt-logprob rows of each line (None: no line asks for any).
        `snapshots`: (restore, save) state snapshots of the lines that have any."""
        bs = self.block_size
        input_ids, positions, slots, qsl, seq_lens, sampling_reqs, samplers = [], [], [], [0], [], [], []
        lp_rows, lp_ids, lp_counts, lp_max = [], [], [], -1
        sampler_drafts = []
        carried, next_ids = [], []
        width = max(len(line.req.block_ids) for line in lines)
        tables = array("q")                    # [B, width], each request's blocks padded with 0
        for b, (req, n, d, rows, samples) in enumerate(lines):
            start = req.num_scheduled_tokens
            end = start + n - rows             # (past the last row that is not a draft row)
            known = req.token_ids[start:end]
            # async scheduling: the one token still unknown here is the one its step in flight
            # samples, and its drafts the ones that step proposes (both filled in on the device)
            carries = len(known) < n - rows
            carried.append(req.carry_row if carries else -1)
            # (dummy draft rows hold token 0: verification never reads them)
            input_ids += known + [0] * (n - rows - len(known)) + ([0] * d if carries else req.draft_ids[:d])
            input_ids += [0] * (rows - d)
            blocks = req.block_ids
            if n == 1:                         # a decode row: most lines of most steps
                positions.append(start)
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = range(start, start + n)
                positions += pos
                slots += [blocks[p // bs] * bs + p % bs for p in pos]
            qsl.append(qsl[-1] + n)
            seq_lens.append(start + n)
            tables += blocks
            tables.frombytes(bytes(8 * (width - len(blocks))))
            next_ids.append(req.token_ids[end] if end < len(req.token_ids) else -1)
            if samples:
                sampling_reqs.append(b)
                samplers.append(req)
                sampler_drafts.append([] if carries else req.draft_ids[:d])
            count = 0
            if req.prompt_logprobs is not None:
                # rows whose next token is a prompt token not yet scored (a recompute scores none twice)
                lo, hi = max(start, req.num_prompt_logprob_rows - 1), min(end, req.num_prompt_tokens - 1)
                if hi > lo:
                    count = hi - lo
                    lp_rows += range(qsl[-2] + lo - start, qsl[-2] + hi - start)
                    lp_ids += req.prompt_token_ids[lo + 1:hi + 1]
                    req.num_prompt_logprob_rows = hi + 1
                    lp_max = max(lp_max, req.params.prompt_logprobs)
            lp_counts.append(count)
        num_carried = sum(c >= 0 for c in carried)
        self.num_carried_rows += num_carried
        return StepPlan(
            step_id=self._step_id,
            input_ids=int64_tensor(input_ids),
            positions=int64_tensor(positions),
            slot_mapping=int64_tensor(slots),
            query_start_loc=int64_tensor(qsl),
            seq_lens=int64_tensor(seq_lens),
            block_tables=torch.frombuffer(tables, dtype=torch.int64).view(len(lines), width),
            sampling_reqs=int64_tensor(sampling_reqs),
            sampling=sampling_tensors(samplers),
            num_draft_rows=int64_tensor([line.num_draft_rows for line in lines]),
            num_drafts=int64_tensor([line.num_drafts for line in lines]),
            next_token_ids=int64_tensor(next_ids),
            state_slots=int64_tensor([line.req.state_slot for line in lines]),
            state_commit=int64_tensor([line.req.state_commit for line in lines]),
            carried=int64_tensor(carried) if num_carried else None,
            state_snapshots=(int64_tensor([x for line in lines for x in snapshots.get(line.req, (-1, -1))])
                             .view(-1, 2) if snapshots else None),
            num_spec_tokens=k,
            drafting=self.drafting is None or self.drafting(),
            num_logprobs=max((r.params.logprobs for r in samplers if r.params.logprobs is not None), default=-1),
            prompt_logprob_rows=int64_tensor(lp_rows) if lp_max >= 0 else None,
            prompt_logprob_ids=int64_tensor(lp_ids) if lp_max >= 0 else None,
            num_prompt_logprobs=lp_max,
            **logits_inputs(samplers, sampler_drafts, k + 1),
            **grammar_inputs(samplers, sampler_drafts, k + 1),
        ), (lp_counts if lp_max >= 0 else None)

    def complete(self, batch: ScheduledBatch, result: StepResult | None = None) -> None:
        """The batch came back: its KV is in the cache up to the accepted drafts (rejected draft rows
        are rolled back by position; their slots get overwritten); free the blocks of requests that
        finished meanwhile. `result` is needed only when a line had draft rows."""
        caching, bs = self.enable_prefix_caching, self.block_size
        for row, (req, n, rows, sampled) in enumerate(zip(batch.requests, batch.num_new_tokens, batch.num_draft_rows,
                                                           batch.samples)):
            req.in_flight -= 1
            req.num_pending_tokens -= n - rows
            req.num_pending_samples -= sampled
            if req.finished:
                if not req.in_flight:      # (async scheduling: its next step may still be out)
                    self._release(req)
                continue
            accepted = len(result.tokens(row)) - 1 if rows else 0
            req.num_computed_tokens += n - rows + accepted
            if caching and req.num_computed_tokens >= (req.num_cached_blocks + 1) * bs:
                self._cache_blocks(req)            # (a block filled up: most steps of most requests fill none)
            # a verify line leaves a candidate linear-attention state per row: the next plan names
            # the one to commit (committed at once otherwise); with a later step of it in flight, that
            # step's result names it (until then the plans continuing it carry it in on the device)
            if not req.in_flight:
                req.state_commit = accepted if rows else -1
        if batch.snapshot_saves:
            self._keep_snapshots(batch.snapshot_saves)

    # -- prefix caching -----------------------------------------------------------------------

    @staticmethod
    def _key_extra(num_spec_tokens: int) -> int:
        """Tokens after a block that its contents depend on, and that its key therefore includes.

        The target's KV at position t depends on tokens 0..t only. The MTP layer's does not: at
        position t it takes the target's hidden state h_t and the embedding of token t + 1 (its
        inputs are shifted left by one, docs/architecture.md, "MTP alignment"), so the MTP entry in a block's last
        slot was computed with the first token of the next block. Two prompts that agree on a block
        but not on the token after it hold different MTP entries there; a block reused with another
        next token would feed the drafter a stale entry (no effect on greedy output, which the target
        verifies, but on acceptance, and a silent difference between cache on and off). So with MTP
        a block's key also holds the token after it, and a block is cached only once that token is
        known and its MTP entry was written with it: after the step that computed the block's last
        position, the MTP entry there was made with the token that followed (the prompt's next token,
        or the token sampled there: `StepLayout.mtp_input_ids`), and no later step writes it again
        (they start at `num_computed_tokens`, past it). Entries at rejected or drafted positions lie
        at or after `num_computed_tokens`, never in a cached block."""
        return 1 if num_spec_tokens else 0

    def _cached_prefix(self, req: Request) -> tuple[list[int], int]:
        """The cached blocks of the longest cached chain of `req`'s full blocks, and the last one's
        cache id. The block holding its last token is never taken: that token is always computed (its
        logits are needed, a whole prompt cached or not), in a block of its own (no shared block is
        written). With MTP that also makes the token after each block taken known (`_key_extra`)."""
        bs, extra, ids = self.block_size, self._extra, req.token_ids
        n = (req.num_tokens - 1) // bs
        return self.allocator.lookup(tuple(ids[i * bs:(i + 1) * bs + extra]) for i in range(n))

    def _cache_blocks(self, req: Request) -> None:
        """Register `req`'s blocks that became full and final since last time: their KV computed
        (`num_computed_tokens`) and, with MTP, the token after them known (`_key_extra`)."""
        bs, extra = self.block_size, self._extra
        full = min(req.num_computed_tokens, req.num_tokens - extra) // bs
        i = req.num_cached_blocks
        if i >= full:
            return
        ids, blocks, parent = req.token_ids, req.block_ids, req.cache_parent
        for i in range(i, full):
            parent = self.allocator.cache(blocks[i], parent, tuple(ids[i * bs:(i + 1) * bs + extra]))
        req.num_cached_blocks, req.cache_parent = full, parent

    def _restorable(self, req: Request, hits) -> tuple[list[int], int, int, tuple[int, ...]]:
        """Linear-attention models: the longest start of the cached chain `hits` whose last block has
        a snapshot of the states where it ends, that block's cache id (ROOT: none), the snapshot (-1:
        none), and where `req`'s prefill takes snapshots (module docstring): the last block boundary
        before its last token, and the end of the cached chain when no snapshot reaches it."""
        bs, snapshots = self.block_size, self.state_snapshots
        chain_end, parent, restore = len(hits) * bs, ROOT, -1
        hits = list(hits)
        while hits:
            parent = self.allocator.cache_id(hits[-1])
            found = snapshots.find(parent)
            if found is not None:
                restore = found
                break
            hits.pop()
        if not hits:
            parent = ROOT
        start, last = len(hits) * bs, (req.num_tokens - 1) // bs * bs
        return hits, parent, restore, tuple(sorted({p for p in (chain_end, last) if p > start}))

    def _snapshot_cut(self, start: int, n: int, points: tuple[int, ...]) -> tuple[int, bool]:
        """A prefill chunk of n tokens from `start`, cut at the first snapshot point past `start`
        when it reaches it and a snapshot slot is free (the state after a chunk is the only one a stage
        holds, so a snapshot is taken at a chunk's end); and whether it ends at that point."""
        point = next((p for p in points if p > start), None)
        if point is None or start + n < point or not self.state_snapshots.can_allocate(1):
            return n, False
        return point - start, True

    def _keep_snapshots(self, saves: list[tuple[Request, int, int]]) -> None:
        """A step's saved snapshots: each is registered under the cache id of the request's KV block
        ending where it was taken (registered by `complete` just before, the request's computed tokens
        having reached it), then left to the LRU. A request that ended meanwhile registered nothing: its
        snapshot is dropped, as is one whose prefix another snapshot already holds."""
        bs, snapshots = self.block_size, self.state_snapshots
        for req, slot, at in saves:
            if not req.finished and req.num_cached_blocks * bs == at:
                snapshots.cache(slot, req.cache_parent, ())
                self.num_snapshot_saves += snapshots.cache_id(slot) != ROOT
            snapshots.free([slot])

    def reset_prefix_cache(self) -> int:
        """Forget every cached block and state snapshot; the number of blocks forgotten. Requests
        holding blocks keep them (what they register later hangs from cache ids that are gone:
        unreachable, it ages out)."""
        if self.state_snapshots is not None:
            self.state_snapshots.reset_cache()
        return self.allocator.reset_cache()

    def prefix_cache_stats(self) -> dict:
        q, h = self.prefix_cache_queries, self.prefix_cache_hits
        stats = {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0, "cached_blocks": self.allocator.num_cached}
        if self.state_snapshots is not None:
            stats.update(cached_state_snapshots=self.state_snapshots.num_cached,
                         state_snapshot_restores=self.num_snapshot_restores,
                         state_snapshot_saves=self.num_snapshot_saves)
        return stats


def sampling_tensors(reqs: list[Request]) -> SamplingTensors:
    ps = [r.params for r in reqs]
    return SamplingTensors(
        temperature=float32_tensor([p.temperature for p in ps]),
        top_k=int64_tensor([p.top_k for p in ps]),
        top_p=float32_tensor([p.top_p for p in ps]),
        min_p=float32_tensor([p.min_p for p in ps]),
        seed=int64_tensor([r.seed for r in reqs]),
        needs_sort=any(p.top_k > 0 or p.top_p < 1.0 for p in ps if not p.greedy),
        all_greedy=all(p.greedy for p in ps),
    )
