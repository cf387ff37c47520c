"""Stage: one pipeline position's model slice, KV cache and, on the last stage, verifier and drafter.

`step(plan, inbound) -> outbound` is the whole of a stage's work for one step, the same at every
pipeline position and for PP = 1 (where the one stage is first and last):

    layout = StepLayout.from_plan(plan)                 the step's geometry, worked out once
    forward                                             target slice: embed (stage 0) + layers;
                                                        replayed from a CUDA graph when steady
    not last -> [2, T, hidden] activations              for the next stage
    last     -> logits at verify rows -> verify (rejection sampling) -> draft K (MTP proposer)
             -> StepResult data [B, result_width(K)]    for the driver

K is the plan's (`plan.num_spec_tokens`): the config's, or with adaptive K any of 0..the config's.

A stage keeps weights and KV cache and nothing derived from earlier steps (I1): every step starts
from the plan alone. Linear-attention layers (Qwen3-Next / Qwen3.5) also keep per-request states in
the slots the plan names, a pure function of the plans received: a verify step keeps a candidate per
row and a later plan's `state_commit` says which one to adopt. With async scheduling (one stage) the
stage also keeps the tokens its last step sampled, which the next plan may name (`plan.carried`):
the driver learns the same tokens from that step's result, so what it records and what the stage
embedded never differ.
"""
from __future__ import annotations

import gc
import logging

import torch

from pipespec.config import EngineConfig
from pipespec.layout import Carry, StepLayout, carry_in
from pipespec.model.attention import CacheShape, ForwardContext, allocate_caches, cache_bytes_per_block
from pipespec.model.linear_state import LinearFlags, LinearMeta, allocate_states, state_bytes
from pipespec.model.placement import resolve_device, resolve_dtype
from pipespec.model.source import ModelSource
from pipespec.parallel import TensorParallel
from pipespec.plan import StepPlan, StepResult, position_margin
from pipespec.sampling import append_logprobs, append_prompt_logprobs, apply_penalties
from pipespec.speculative.loading import build_proposer
from pipespec.speculative.rejection import verify
from pipespec.stage import memory
from pipespec.stage.cuda_graphs import CudaGraphs, Forward, GraphsByK
from pipespec.stage.target import load_target, run_target
from pipespec.stage.device import (choose_backend, finish_within, prefer_column_major, tensors_off_device,
                                   use_device)
from pipespec.stage.result import finish_step
from pipespec.stage.trace import DraftTrace

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
        if self.device.type == "cpu":
            for module in self.modules_with_weights():
                prefer_column_major(module)
        self.kv_caches = None
        self.linear_states = None          # Gated DeltaNet layers: per-request state slots
        self.num_blocks = 0
        self.graphs: GraphsByK | None = None
        self.trace = DraftTrace() if config.parallel.check_collectives else None
        # async scheduling: what each row of the last sampling step leaves for the next, on the device
        self.carry, self._fill = None, carry_in
        if config.overlaps_steps(self.device.type):
            self.carry = Carry.zeros(config.scheduler.max_num_seqs, self.num_spec_tokens, self.device)
            if self.device.type == "cuda":       # one kernel instead of ~30 small ops, in every graph
                from pipespec.kernels.carry_in import carry_in as fill
                self._fill = fill
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

    def available_kv_blocks(self) -> int:
        # buffers too: quantized layers keep their packed weights there (model/quant/linear.py)
        weights = sum(t.numel() * t.element_size() for m in self.modules_with_weights()
                      for t in (*m.parameters(), *m.buffers()))
        # linear-attention states are a fixed amount, like the weights
        fixed = weights + state_bytes(self._state_shapes(), self._state_slots(), self.num_spec_tokens + 1, self.dtype)
        return memory.available_kv_blocks(self.config, self.model.arch, self.device, fixed,
                                          self._bytes_per_block())

    def _state_shapes(self) -> list:
        return self.model.state_shapes() if hasattr(self.model, "state_shapes") else []

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

    def allocate_kv_cache(self, num_blocks: int) -> None:
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
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s", num_blocks, self.block_size,
                    num_blocks * self._bytes_per_block() / 2**20, self.device)
        if graphs:
            max_blocks = -(-(self.max_model_len + position_margin(self.num_spec_tokens)) // self.block_size)
            # one set of graphs per K a step may use: adaptive K moves between all of 0..K and an
            # eager step costs several graph replays, which would skew the costs it measures
            ks = range(self.num_spec_tokens + 1) if self._adaptive else [self.num_spec_tokens]
            self.graphs = GraphsByK({k: CudaGraphs(self.model, self.drafter, self.backend, self.kv_caches,
                                                   self.block_size, k, self.config.scheduler.max_num_seqs,
                                                   pad_block=num_blocks, max_blocks_per_seq=max_blocks,
                                                   linear_states=self.linear_states,
                                                   pad_slot=self._state_slots() - 1, mixed_k=self._adaptive,
                                                   carry=self.carry, fill=self._fill)
                                     for k in ks})
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
        gc.collect()

    # -- the step -------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, plan: StepPlan, inbound: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage's part of `plan` (on the host; it is moved here as needed).

        inbound: [2, T, hidden] (hidden, residual) from the previous stage; None on stage 0.
        Returns [2, T, hidden] activations for the next stage, or on the last stage the StepResult
        data [B, result_width(K)]; both on the stage's device (the runtime moves a result to the host).
        """
        layout = StepLayout.from_plan(plan, plan.num_spec_tokens)
        if layout.carried is not None and (self.carry is None or self._sampled_step != plan.step_id - 1):
            raise RuntimeError(f"step {plan.step_id} carries tokens of step {plan.step_id - 1}, which this stage "
                               + ("does not keep (async scheduling is off)" if self.carry is None
                                  else f"did not sample (its last sampling step was {self._sampled_step})"))
        if self.trace is not None:
            self.trace.record(plan.step_id, layout, embeds=self.is_first, verifies=self.is_last)
        if self.graphs is not None and self.graphs.fits(layout, self.is_last):
            fwd = self.graphs.forward(layout, inbound)
        else:
            fwd = self._forward(layout, inbound)
        if not self.is_last:
            out = torch.stack((fwd.hidden, fwd.residual))
            self._bounded_wait(f"step {plan.step_id}")
            return out
        data = self._sample(plan, fwd)
        if plan.num_prompt_logprobs >= 0:     # rows of prefill chunks: never a CUDA graph's steady step
            rows = plan.prompt_logprob_rows.to(self.device)
            data = append_prompt_logprobs(data, self.model.compute_logits(fwd.hidden[rows]),
                                          plan.prompt_logprob_ids.to(self.device), plan.num_prompt_logprobs)
        return data

    def _bounded_wait(self, what: str) -> None:
        """TP on CUDA: the collectives may be in a replayed graph, out of NCCL's watchdog's sight;
        wait for `what` with a bound (`finish_within`: past it, the TP communicator is aborted)."""
        if self.tp.size > 1 and self.device.type == "cuda":
            finish_within(self.config.parallel.stage_timeout, self.tp, f"{what} of TP rank {self.tp.rank}")

    @torch.inference_mode()
    def forward(self, plan: StepPlan, inbound: torch.Tensor | None = None) -> Forward:
        """The target slice alone, eagerly (logit-parity checks read `hidden` and `model`)."""
        return self._forward(StepLayout.from_plan(plan, plan.num_spec_tokens), inbound)

    def _forward(self, host_layout: StepLayout, inbound: torch.Tensor | None) -> Forward:
        layout = host_layout.to(self.device)
        if layout.carried is not None:
            layout = layout.carried_in(self.carry, self.block_size, self._fill)
        attn = self.backend.prepare(layout.query_start_loc, layout.seq_lens, layout.positions,
                                    layout.block_tables, self.block_size, max_query_len=layout.max_query_len)
        ctx = ForwardContext(layout.positions, layout.slot_mapping, self.backend, attn, self.kv_caches)
        if self.linear_states is not None:
            flags = LinearFlags.of(host_layout.max_query_len, host_layout.state_commit, host_layout.req_num_drafts)
            ctx.linear = LinearMeta.build(layout.query_start_loc, layout.positions, layout.state_slots,
                                          layout.state_commit, layout.req_num_drafts, self.linear_states, flags)
        hidden, residual = run_target(self.model, ctx, layout.input_ids, inbound)
        return Forward(layout, ctx, hidden, residual)

    def _sample(self, plan: StepPlan, fwd: Forward) -> torch.Tensor:
        """Last stage: verify each sampling request's drafts (none: plain sampling), then draft anew;
        the StepResult data. Logits are computed only at each sampling request's verify rows."""
        layout = fwd.layout
        k = layout.num_spec_tokens                # the plan's: adaptive K may ask for fewer than the config's
        s = layout.num_samplers
        if s == 0:
            if self.drafter is not None:      # keep the MTP KV written where later steps attend
                self.drafter.write_kv(fwd.ctx, layout, fwd.hidden)
            return StepResult.empty(plan.step_id, plan.num_reqs, k).data
        replayed = fwd.ctx is None
        logits = None
        # a step that processes its logits verifies them eagerly, never by the graph's greedy shortcut
        shortcut = replayed and plan.sampling.all_greedy and not plan.adjusts_logits
        if not shortcut or plan.num_logprobs >= 0:
            logits = fwd.logits
            if logits is None:
                logits = self.model.compute_logits(fwd.hidden[layout.verify_rows.reshape(-1)])
            logits = logits.view(s, k + 1, -1)
        if shortcut:
            data = self.graphs.finish()       # the forward graph verified greedily
        else:
            # greedy verification reads no sampling tensor: spare their upload
            sampling = plan.sampling if plan.sampling.all_greedy else plan.sampling.to(self.device)
            processed = logits
            if plan.adjusts_logits:           # penalties, bias, bans (logprobs stay the raw model's)
                processed = apply_penalties(logits, layout.draft_ids, layout.num_drafts,
                                            *(None if t is None else t.to(self.device) for t in
                                              (plan.penalties, plan.penalty_tokens, plan.bias_entries,
                                               plan.bias_values)))
            tokens, num_sampled = verify(processed, layout, sampling)
            if replayed:
                data = self.graphs.finish(tokens, num_sampled)
            else:
                data = finish_step(self.drafter, fwd.ctx, layout, fwd.hidden, tokens, num_sampled, k,
                                   plan.num_reqs, self.carry)
        if plan.num_logprobs >= 0:            # of the raw logits at the verify rows (`plan.result_width`)
            data = append_logprobs(data, logits, layout.sample_rows, k, plan.num_logprobs)
        self._bounded_wait(f"step {plan.step_id}")      # before the result's copy to the host, a sync without a bound
        if self.carry is not None:
            self._sampled_step = plan.step_id
        return data

