"""Stage: one pipeline position's model slice, KV cache and, on the last stage, verifier and drafter.

`step(plan, inbound) -> outbound` is the whole of a stage's work for one step, the same at every
pipeline position and for PP = 1 (where the one stage is first and last):

    inp = buffers.write(plan)                           the step's inputs, laid out once in buffers
                                                        the stage owns (`step_input.py`)
    forward                                             target slice: embed (stage 0) + layers;
                                                        replayed from a CUDA graph when steady
    not last -> [2, T, hidden] activations              for the next stage
    last     -> logits at verify rows -> verify (`speculative/rejection.py`)
             -> finish: draft K (MTP proposer), StepResult data [B, result_width(K)] for the driver

K is the plan's (`plan.num_spec_tokens`): the config's, or with adaptive K any of 0..the config's.

A stage keeps weights and KV cache and nothing derived from earlier steps (I1): every step starts
from the plan alone. Linear-attention layers (Qwen3-Next / Qwen3.5) also keep per-request states in
the slots the plan names, a pure function of the plans received: a verify step keeps a candidate per
row and a later plan's `state_commit` says which one to adopt. With async scheduling (one stage) the
stage also keeps the tokens its last step sampled, which the next plan may name (`stage/carry.py`).
"""
from __future__ import annotations

import gc
import hashlib
import logging

import numpy as np
import torch

from pipespec.checkpoint.source import ModelSource
from pipespec.config import EngineConfig
from pipespec.model.attention import CacheShape, ForwardContext, allocate_caches, cache_bytes_per_block, choose_backend
from pipespec.model.linear_state import LinearFlags, LinearMeta, StateSnapshots, allocate_states, state_bytes
from pipespec.parallel import TensorParallel
from pipespec.placement import resolve_device, resolve_dtype
from pipespec.plan import CacheSizes, StepPlan, StepResult, position_margin
from pipespec.sampling import (append_logprobs, append_prompt_logprobs, apply_penalties, apply_token_bitmask,
                               to_device)
from pipespec.speculative.loading import build_proposer
from pipespec.stage import memory
from pipespec.stage.carry import Carry, carried_tokens
from pipespec.stage.cuda_graphs import CudaGraphs, GraphsByK
from pipespec.stage.device import tensors_off_device, use_device
from pipespec.stage.step_input import Padding, StepBuffers, StepInput, verify
from pipespec.stage.target import load_target, run_target

logger = logging.getLogger(__name__)


class Stage:
    def __init__(self, source: ModelSource, config: EngineConfig, layer_range: tuple[int, int],
                 max_model_len: int, tp: TensorParallel | None = None):
        """`tp`: this rank's place in the stage's tensor-parallel group (None: TP = 1); the runtime
        attaches its process group before the first step."""
        self.config = config
        self.tp = tp or TensorParallel()
        self.device = use_device(resolve_device(config.model.device))
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.num_spec_tokens = config.num_spec_tokens
        max_position = max_model_len + position_margin(self.num_spec_tokens)
        self.model = load_target(source, config, layer_range, max_position, self.dtype, self.device, self.tp)
        self.backend = choose_backend(config.model.attention_backend, self.device, self.model)
        self.drafter = None
        if self.is_last and self.num_spec_tokens:
            self.drafter = build_proposer(self.model, source, config, self.dtype, self.device, max_position,
                                          self.tp)
        self.kv_caches = None
        self.linear_states = None          # Gated DeltaNet layers: per-request state slots
        self.state_snapshots = None        # and the prefix cache's snapshots of them
        self.num_blocks = 0
        self.graphs: GraphsByK | None = None
        self.trace = DraftTrace() if config.parallel.check_collectives else None
        # async scheduling: what each row of the last sampling step leaves for the next, on the device
        self.carry = None
        if config.async_scheduling_on(self.device.type):
            self.carry = Carry.zeros(config.scheduler.max_num_seqs, self.num_spec_tokens, self.device)
        self.buffers: StepBuffers | None = None      # sized with the KV cache (`allocate_kv_cache`)
        self._sampled_step = -1

    @property
    def _adaptive(self) -> bool:
        return bool(self.config.speculative and self.config.speculative.adaptive)

    @property
    def is_first(self) -> bool:
        return self.model.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.model.is_last

    def modules_with_weights(self):
        yield self.model
        if self.drafter is not None:
            yield self.drafter         # its MTP layers and, where it has one, its embedding copy

    # -- KV cache -------------------------------------------------------------------------------

    def _cache_shapes(self) -> list[CacheShape]:
        """The target slice's caches, then the drafter's (one per MTP layer)."""
        drafter = [layer.cache_shape() for layer in self.drafter.layers] if self.drafter else []
        return self.model.cache_shapes() + drafter

    def _bytes_per_block(self) -> int:
        return cache_bytes_per_block(self._cache_shapes(), self.block_size, self.dtype)

    def available_cache(self) -> CacheSizes:
        """KV blocks and linear-attention state snapshots this stage can hold (`stage/memory.py`)."""
        # buffers too: quantized layers keep their packed weights there (model/quant/linear.py)
        weights = sum(t.numel() * t.element_size() for m in self.modules_with_weights()
                      for t in (*m.parameters(), *m.buffers()))
        # linear-attention states are a fixed amount, like the weights
        shapes = self._state_shapes()
        fixed = weights + state_bytes(shapes, self._state_slots(), self.num_spec_tokens + 1, self.dtype)
        budget = memory.cache_budget(self.config, self.model.arch, self.device, fixed)
        per_block, per_snapshot = self._bytes_per_block(), state_bytes(shapes, 1, 0, self.dtype)
        snapshots = None
        if per_snapshot and self.config.cache.enable_prefix_caching:
            snapshots = memory.available_snapshots(self.config, budget, per_snapshot, per_block)
            if budget is not None:
                budget -= snapshots * per_snapshot
        return CacheSizes(memory.available_kv_blocks(self.config, self.device, budget, per_block), snapshots)

    def _state_shapes(self) -> list:
        return self.model.state_shapes()

    def _state_slots(self) -> int:
        # one per request the scheduler may run, and one more, never handed out, that takes the
        # writes of a CUDA graph's padding requests
        return self.config.scheduler.max_num_seqs + 1

    @property
    def uses_cuda_graphs(self) -> bool:
        # a TP group over gloo (distributed_backend='gloo', GPUs shared for testing) runs its
        # collectives on the host, which a graph cannot capture
        gloo_tp = self.tp.size > 1 and self.config.parallel.distributed_backend == "gloo"
        return self.backend.supports_cuda_graphs and not self.config.model.enforce_eager and not gloo_tp

    def allocate_kv_cache(self, num_blocks: int, num_snapshots: int = 0) -> None:
        """`num_snapshots`: prefix-cache snapshots of the linear-attention states (every stage with
        such layers keeps the same count: the least any of them can hold)."""
        graphs = self.uses_cuda_graphs
        # with CUDA graphs one more block, never handed out, takes the writes of padding requests
        caches = allocate_caches(self._cache_shapes(), num_blocks + graphs, self.block_size, self.dtype, self.device)
        n = len(self.model.cache_shapes())
        self.kv_caches = caches[:n]
        if self.drafter:
            self.drafter.kv_caches = caches[n:]
        if self._state_shapes():
            # a slot per request and a candidate per verify row
            self.linear_states = allocate_states(self._state_shapes(), self._state_slots(),
                                                 self.num_spec_tokens + 1, self.dtype, self.device)
            n = num_snapshots
            if n:
                self.state_snapshots = StateSnapshots.allocate(self._state_shapes(), n, self.dtype, self.device)
                each = state_bytes(self._state_shapes(), 1, 0, self.dtype) / 2**20
                logger.info("prefix cache: %d snapshots of this stage's linear-attention states fit, %.1f MiB "
                            "each, %.1f MiB in all (--prefix-cache-state-snapshots)", n, each, n * each)
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s", num_blocks, self.block_size,
                    num_blocks * self._bytes_per_block() / 2**20, self.device)
        k = self.num_spec_tokens
        sched = self.config.scheduler
        max_blocks = -(-(self.max_model_len + position_margin(k)) // self.block_size)
        self.buffers = StepBuffers(self.device, max(sched.max_num_batched_tokens, sched.max_num_seqs * (k + 1)),
                                   sched.max_num_seqs, max_blocks, k,
                                   Padding(block=num_blocks, slot=self._state_slots() - 1, block_size=self.block_size))
        if graphs:
            # one set of graphs per K a step may use: adaptive K moves between all of 0..K and an
            # eager step costs several graph replays, which would skew the costs it measures
            ks = range(k + 1) if self._adaptive else [k]
            self.graphs = GraphsByK({n: CudaGraphs(self.model, self.drafter, self.backend, self.kv_caches, self.buffers,
                                                   self.block_size, n, sched.max_num_seqs, self._finish,
                                                   linear_states=self.linear_states, mixed_k=self._adaptive,
                                                   carry=self.carry)
                                     for n in ks})
            self.graphs.capture()
        off = tensors_off_device(self, self.device)
        if off:   # cheap, once: a stage touching another device fails at its first kernel otherwise
            raise RuntimeError(f"stage on {self.device} holds tensors elsewhere: {', '.join(off[:5])}")

    def close(self) -> None:
        """Free the CUDA graphs, then the TP group whose collectives they captured (in that order:
        `TensorParallel.close`). The stage takes no more steps. A TP stage on CUDA first waits,
        bounded, for its last GPU work: a replayed collective stuck on a dead peer is aborted
        (`finish_within`), so neither the graphs' release nor the group's shutdown waits for ever."""
        if self.graphs is not None:
            try:
                self._bounded_wait("the stage's last GPU work")
            except TimeoutError:
                pass                  # the communicator is aborted: what was stuck on it has ended
            self.graphs.release()
        self.graphs = None
        self.tp.close()
        if self.device.type == "cuda":     # the graphs' pool and the group's buffers, before the next engine
            gc.collect()

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, plan: StepPlan, inbound: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's part of `plan` (on the host; its inputs are uploaded here).

        inbound: [2, T, hidden] (hidden, residual) from the previous stage; None on stage 0.
        Returns [2, T, hidden] activations for the next stage, or on the last stage the StepResult
        data [B, result_width(K)]; both on the stage's device (the runtime moves a result to the host).
        """
        if plan.carried is not None and (self.carry is None or self._sampled_step != plan.step_id - 1):
            raise RuntimeError(f"step {plan.step_id} carries tokens of step {plan.step_id - 1}, which this stage "
                               + ("does not keep (async scheduling is off)" if self.carry is None
                                  else f"did not sample (its last sampling step was {self._sampled_step})"))
        bucket = self.graphs.bucket_for(plan) if self.graphs is not None else None
        inp = self.buffers.write(plan, pad_to=bucket)
        self._copy_snapshots(plan, restore=True)
        if self.trace is not None:
            self.trace.record(plan.step_id, self.buffers.embedded_drafts(), embeds=self.is_first,
                              verifies=self.is_last)
        if bucket is not None:
            ctx, (hidden, residual, logits) = None, self.graphs.forward(bucket, inp, inbound)
        else:
            ctx, logits = self._context(plan, inp), None
            hidden, residual = run_target(self.model, ctx, inp.input_ids, inbound)
        self._copy_snapshots(plan, restore=False)
        if not self.is_last:
            out = torch.stack((hidden, residual))
            self._bounded_wait(f"step {plan.step_id}")
            return out
        data = self._verify_and_finish(plan, inp, ctx, hidden, logits)
        self._bounded_wait(f"step {plan.step_id}")      # before the result's copy to the host, a sync without a bound
        if self.carry is not None:
            self._sampled_step = plan.step_id
        return data

    def _copy_snapshots(self, plan: StepPlan, restore: bool) -> None:
        """Prefix caching of linear-attention states (`StepPlan.state_snapshots`): before the step,
        restore the snapshots its hits name into their requests' slots; after the forward, save the
        slots of the requests whose prefill reached a snapshot boundary. All restores of a step come
        before all its saves, and a stage runs steps in plan order, so a snapshot the driver hands
        out again for a save is read by every restore planned before (`Scheduler`)."""
        if plan.state_snapshots is None or self.linear_states is None:
            return
        column = plan.state_snapshots[:, 0 if restore else 1]
        picked = column >= 0
        if not bool(picked.any()):
            return
        if self.state_snapshots is None:
            raise RuntimeError(f"step {plan.step_id} names linear-attention state snapshots, which this stage "
                               "does not keep (prefix_cache_state_snapshots differs between driver and stage)")
        snapshots, slots = to_device(column[picked], self.device), to_device(plan.state_slots[picked], self.device)
        if restore:
            self.state_snapshots.restore(self.linear_states, snapshots, slots)
        else:
            self.state_snapshots.save(self.linear_states, slots, snapshots)

    def _bounded_wait(self, what: str) -> None:
        """TP on CUDA: the collectives may be in a replayed graph, out of NCCL's watchdog's sight;
        wait for `what` with a bound (`finish_within`: past it, the TP communicator is aborted)."""
        if self.tp.size > 1 and self.device.type == "cuda":
            self.tp.finish_within(self.config.parallel.stage_timeout, f"{what} of TP rank {self.tp.rank}")

    @torch.inference_mode()
    def forward(self, plan: StepPlan, inbound: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target slice alone, eagerly: (hidden, residual) (logit-parity checks read them)."""
        inp = self.buffers.write(plan)
        return run_target(self.model, self._context(plan, inp), inp.input_ids, inbound)

    def _context(self, plan: StepPlan, inp: StepInput) -> ForwardContext:
        """An eager step's forward context, after taking in what async scheduling carries."""
        if plan.carried is not None:
            self.carry.fill(inp, self.block_size)
        attn = self.backend.prepare(inp.query_start_loc, inp.seq_lens, inp.positions, inp.block_tables,
                                    self.block_size, max_query_len=inp.max_query_len)
        ctx = ForwardContext(inp.positions, inp.slot_mapping, self.backend, attn, self.kv_caches)
        if self.linear_states is not None:
            flags = LinearFlags.of(inp.max_query_len, plan.state_commit, plan.num_draft_rows)
            ctx.linear = LinearMeta.build(inp.query_start_loc, inp.positions, inp.state_slots, inp.state_commit,
                                          inp.num_draft_rows, self.linear_states, flags)
        return ctx

    def _verify_and_finish(self, plan: StepPlan, inp: StepInput, ctx: ForwardContext | None,
                           hidden: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """Last stage: verify each sampling request's line (no drafts: plain sampling), then finish;
        the StepResult data, with the logprobs the plan asks for. `ctx` None: the step was replayed
        from a CUDA graph, whose forward computed every row's `logits` and verified greedily, and
        whose finish graph drafts."""
        drafting = self.drafter is not None and plan.drafting
        if inp.num_lines:
            data = self._verify_lines(plan, inp, ctx, hidden, logits, drafting)
        else:
            if drafting:      # keep the MTP KV written where later steps attend
                self.drafter.write_kv(ctx, inp.mtp_input_ids, hidden)
            data = StepResult.empty(plan.step_id, plan.num_reqs, inp.num_spec_tokens).data
        if plan.num_prompt_logprobs >= 0:     # rows of prefill chunks: never a CUDA graph's steady step
            rows = to_device(plan.prompt_logprob_rows, self.device)
            data = append_prompt_logprobs(data, self.model.compute_logits(hidden[rows]),
                                          to_device(plan.prompt_logprob_ids, self.device), plan.num_prompt_logprobs)
        return data

    def _verify_lines(self, plan: StepPlan, inp: StepInput, ctx: ForwardContext | None, hidden: torch.Tensor,
                      logits: torch.Tensor | None, drafting: bool) -> torch.Tensor:
        k, s = inp.num_spec_tokens, inp.num_lines
        # a step that processes its logits verifies them eagerly, never by the graph's greedy shortcut
        shortcut = ctx is None and plan.sampling.all_greedy and not plan.adjusts_logits
        if not shortcut:
            if logits is None:     # eager: the LM head at verify rows only
                logits = self.model.compute_logits(hidden[inp.verify_rows.reshape(-1)])
            logits = logits.view(s, k + 1, -1)
        if shortcut:
            data = self.graphs.finish(drafting=drafting)
        else:
            processed = logits
            if plan.penalties is not None or plan.bias_entries is not None:
                # penalties, bias, bans (logprobs stay the raw model's)
                # (async scheduling: the tokens a carried line's step in flight sampled count too)
                carries = plan.carried is not None and plan.penalties is not None
                if ctx is None:       # replayed: so is the processing
                    processed = self.graphs.processed_logits(plan, carries)
                else:
                    processed = apply_penalties(logits, inp.draft_ids, inp.line_drafts,
                                                *(None if t is None else to_device(t, self.device) for t in
                                                  (plan.penalties, plan.penalty_tokens, plan.bias_entries,
                                                   plan.bias_values)),
                                                carried=carried_tokens(inp, self.carry) if carries else None)
            if plan.grammar_masks is not None:     # structured output: what the grammar forbids is -inf
                processed = apply_token_bitmask(logits.float().clone() if processed is logits else processed,
                                                to_device(plan.grammar_lines, self.device),
                                                to_device(plan.grammar_masks, self.device))
            if ctx is None and plan.grammar_masks is None:     # replayed: so is the verification
                self.graphs.verify(plan.sampling, processed is not logits)
                data = self.graphs.finish(drafting=drafting)
            else:
                # greedy verification reads no sampling tensor: spare their upload
                sampling = None if plan.sampling.all_greedy else plan.sampling.to(self.device)
                tokens, num_sampled = verify(processed, inp, sampling)
                if ctx is None:
                    data = self.graphs.finish(tokens, num_sampled, drafting)
                else:
                    data = self._finish(ctx, inp, hidden, tokens, num_sampled, drafting)
        if plan.num_logprobs >= 0:            # of the raw logits at the verify rows (`plan.result_width`)
            if ctx is None:                   # replayed: so are its logprobs, after the finish set the tokens
                data = torch.cat((data, self.graphs.logprobs(plan.num_logprobs)), dim=1)
            else:
                data = append_logprobs(data, logits, inp.sampling_reqs, k, plan.num_logprobs)
        return data

    def _finish(self, ctx: ForwardContext, inp: StepInput, hidden: torch.Tensor, tokens: torch.Tensor,
                num_sampled: torch.Tensor, drafting: bool) -> torch.Tensor:
        """The end of a last stage's step, eager or captured as a CUDA graph's finish: the next step's
        drafts (from each line's last accepted row; `drafting` False: none, the drafter retired), the
        StepResult data, what async scheduling carries. tokens [S, 1 + K] (-1 past the end) and
        num_sampled [S]; no host sync."""
        k, drafts = inp.num_spec_tokens, None
        if drafting:
            last = num_sampled - 1
            last_tokens = tokens.gather(1, last[:, None]).squeeze(1)
            drafts = self.drafter.propose(ctx, inp.mtp_input_ids, inp.block_tables[inp.sampling_reqs], hidden,
                                          inp.verify_rows[:, 0] + last, last_tokens, k)
        data = StepResult.from_verification(0, inp.num_reqs, k, inp.sampling_reqs, tokens, num_sampled, drafts).data
        if self.carry is not None:
            self.carry.keep(data, k, inp.num_draft_rows)
        return data


class DraftTrace:
    """The I4 debug trace (on with the collective check, `check_collectives`): per step, a digest of
    the draft ids the first stage embedded and the last stage verified. The driver compares them
    (`runtime.symmetry`), so a plan whose drafts did not reach stage 0 (the original PP + MTP bug: it
    embedded zeros) is caught by name, not only through lossless output."""

    def __init__(self):
        self.embedded: dict[int, str] = {}
        self.verified: dict[int, str] = {}

    def record(self, step_id: int, drafts: np.ndarray | None, embeds: bool, verifies: bool) -> None:
        """`drafts` [S, K]: the draft rows' ids, -1 where no draft (None: the step has none)."""
        if drafts is None:
            return
        digest = hashlib.sha1(drafts.tobytes()).hexdigest()[:16] + f"/{int((drafts >= 0).sum())}"
        if embeds:
            self.embedded[step_id] = digest
        if verifies:
            self.verified[step_id] = digest

    def report(self) -> dict:
        return {"embedded": {str(k): v for k, v in self.embedded.items()},
                "verified": {str(k): v for k, v in self.verified.items()}}
