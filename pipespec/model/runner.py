"""StageRunner: one pipeline stage's model slice, KV cache and (on the last stage) sampler.

It turns a StepPlan into the stage's output: (hidden, residual) for the next stage, or a StepResult
on the last stage. It keeps weights and KV cache and nothing derived from earlier steps (I1).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pipespec import kernels
from pipespec.config import EngineConfig
from pipespec.model.attention import (AttentionBackend, ForwardContext, TorchReferenceBackend,
                                      allocate_kv_caches, kv_bytes_per_block)
from pipespec.model.layers import LMHead
from pipespec.model.llama import LlamaForCausalLM
from pipespec.model.source import ModelSource
from pipespec.model.weights import init_dummy_weights, load_weights
from pipespec.plan import StepPlan, StepResult
from pipespec.spec.rejection import rejection_sample

logger = logging.getLogger(__name__)

_CPU_DEFAULT_KV_BYTES = 1 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return _DTYPES[dtype]


def choose_backend(choice: str, device: torch.device) -> AttentionBackend:
    """The attention backend for `choice` ("auto", "torch", "triton") on `device`."""
    can_triton = device.type == "cuda" and kernels.HAVE_TRITON
    if choice == "triton" and not can_triton:
        raise ValueError(f"attention_backend='triton' needs a CUDA device and the triton package; "
                         f"this stage runs on {device} (triton installed: {kernels.HAVE_TRITON})")
    if choice == "triton" or (choice == "auto" and can_triton):
        from pipespec.model.triton_backend import TritonPagedBackend
        return TritonPagedBackend()
    return TorchReferenceBackend()


@dataclass
class _Step:
    """What `forward` leaves for `sample` in the same step."""

    step_id: int
    plan: StepPlan | None            # on this stage's device (None: replayed from a CUDA graph)
    ctx: ForwardContext | None


def prefer_column_major(module: torch.nn.Module) -> None:
    """Store every layer's [out, in] matrix transposed in memory (same values, same shape).

    On CPU, MKL's matrix-vector product reads such a layout ~1.3x faster, which is what batch-1
    decode is made of (measured: 18.1 -> 20.6 tok/s on SmolLM2; RESULTS.md). Embeddings and LM heads
    stay row-major: lookups want rows, and `head_logits` is fastest on a row-major head at any row
    count (one row 3.8 ms against 5.1 column-major, four rows 4.5 against 19-24 ms).
    """
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and not isinstance(m, LMHead):
            m.weight.data = m.weight.data.t().contiguous().t()


class StageRunner:
    def __init__(self, source: ModelSource, config: EngineConfig, layer_range: tuple[int, int],
                 max_model_len: int, num_spec_tokens: int | None = None):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.num_spec_tokens = config.num_spec_tokens if num_spec_tokens is None else num_spec_tokens
        # drafted positions run up to 2K past the last verified one
        max_position = max_model_len + 2 * self.num_spec_tokens
        self.model = LlamaForCausalLM(source.arch, layer_range, max_position=max_position)
        if config.model.load_format == "dummy":
            init_dummy_weights(self.model, self.dtype, self.device, seed=layer_range[0])
        else:
            load_weights(self.model, source.weights(), self.dtype, self.device,
                         desc=f"Loading layers {layer_range[0]}-{layer_range[1] - 1}")
        self.model.eval()
        self.backend = choose_backend(config.model.attention_backend, self.device)
        self.graphs = None
        self.kv_caches = None
        self.num_blocks = 0
        self.proposer = None
        if self.is_last and self.num_spec_tokens:
            from pipespec.spec.mtp_loading import build_proposer
            self.proposer = build_proposer(self, source, config, max_position)
        if self.device.type == "cpu":
            for module in self._modules_with_weights():
                prefer_column_major(module)
        self._step: _Step | None = None

    @property
    def is_first(self) -> bool:
        return self.model.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.model.is_last

    @property
    def _num_cache_layers(self) -> int:
        return self.model.num_local_layers + (len(self.proposer.layers) if self.proposer else 0)

    def _bytes_per_block(self) -> int:
        arch = self.model.arch
        return kv_bytes_per_block(self._num_cache_layers, self.block_size, arch.num_kv_heads,
                                  arch.head_dim, self.dtype)

    def available_kv_blocks(self) -> int:
        """Blocks this stage can hold: from the config on CPU, from measured memory on GPU."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        if self.device.type == "cuda" and cache.kv_cache_memory is None:
            # this engine may fill `gpu_memory_utilization` of the card with its weights, activations
            # and KV cache, and never more than is free (other engines or processes keep theirs)
            torch.cuda.empty_cache()   # memory cached from earlier engines is not in use
            free, total = torch.cuda.mem_get_info(self.device)
            reserve = self._activation_reserve()
            own = sum(p.numel() * p.element_size() for p in self._all_parameters())
            budget = min(total * cache.gpu_memory_utilization - own - reserve, free - reserve)
            return max(int(budget // self._bytes_per_block()), 0)
        return max(int((cache.kv_cache_memory or _CPU_DEFAULT_KV_BYTES) // self._bytes_per_block()), 1)

    def _modules_with_weights(self):
        yield self.model
        if self.proposer is not None:
            yield self.proposer        # its MTP layers and, where it has one, its embedding copy

    def _all_parameters(self):
        for module in self._modules_with_weights():
            yield from module.parameters()

    def _activation_reserve(self) -> int:
        # activations of the largest step: hidden, MLP intermediate and logits rows, with slack
        arch = self.model.arch
        tokens = self.config.scheduler.max_num_batched_tokens
        per_token = (4 * arch.hidden_size + 3 * arch.intermediate_size
                     + (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim) * 4
        logits = self.config.scheduler.max_num_seqs * (self.num_spec_tokens + 1) * arch.vocab_size * 4 * 4
        return 2 * (tokens * per_token + logits) + (256 << 20)

    @property
    def uses_cuda_graphs(self) -> bool:
        from pipespec.model.triton_backend import TritonPagedBackend
        return isinstance(self.backend, TritonPagedBackend) and not self.config.model.enforce_eager

    def allocate_kv_cache(self, num_blocks: int) -> None:
        arch = self.model.arch
        graphs = self.uses_cuda_graphs
        # with CUDA graphs one more block, never handed out, takes the writes of padding requests
        caches = allocate_kv_caches(self._num_cache_layers, num_blocks + graphs, self.block_size,
                                    arch.num_kv_heads, arch.head_dim, self.dtype, self.device)
        n = self.model.num_local_layers
        self.kv_caches = caches[:n]
        if self.proposer:
            self.proposer.kv_caches = caches[n:]
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB) on %s", num_blocks, self.block_size,
                    num_blocks * self._bytes_per_block() / 2**20, self.device)
        if graphs:
            from pipespec.model.cuda_graphs import DecodeGraphs
            max_blocks = -(-(self.max_model_len + 2 * self.num_spec_tokens) // self.block_size)
            self.graphs = DecodeGraphs(self, self.config.scheduler.max_num_seqs, num_blocks, max_blocks)
            self.graphs.capture()

    def _context(self, plan: StepPlan, host_plan: StepPlan) -> ForwardContext:
        attn = self.backend.prepare(plan.query_start_loc, plan.seq_lens, plan.positions, plan.block_tables,
                                    self.block_size, max_query_len=host_plan.max_query_len())
        return ForwardContext(plan.positions, plan.slot_mapping, self.backend, attn, self.kv_caches)

    def _begin(self, plan: StepPlan) -> _Step:
        dplan = plan.to(self.device)
        self._step = _Step(plan.step_id, dplan, self._context(dplan, plan))
        return self._step

    @torch.inference_mode()
    def forward(self, plan: StepPlan, hidden: torch.Tensor | None = None,
                residual: torch.Tensor | None = None):
        """Run this stage's layers for `plan` (best passed on the host: it is moved here as needed)."""
        if self.graphs is not None and self.graphs.fits(plan):
            self._step = _Step(plan.step_id, None, None)
            return self.graphs.forward(plan, hidden, residual)
        step = self._begin(plan)
        return self.model(step.ctx, input_ids=step.plan.input_ids if self.is_first else None,
                          hidden=hidden, residual=residual)

    @torch.inference_mode()
    def sample(self, plan: StepPlan, hidden: torch.Tensor) -> StepResult:
        """Last stage: verify each sampling request's drafts (none: plain sampling), then draft anew.

        Logits are computed only at each sampling request's last real row and its draft rows.
        """
        k = self.num_spec_tokens
        step = self._step if self._step is not None and self._step.step_id == plan.step_id else self._begin(plan)
        if step.plan is None:                      # a steady step replayed from a CUDA graph
            g = self.graphs
            logits = g.logits()                                            # [B, K+1, V]
            b = logits.shape[0]
            first_rows, sample_rows, num_drafts = g.query_start_loc[:b], g.sample_rows[:b], g.num_drafts[:b]
            draft_ids = g.ints["input_ids"][:b * (k + 1)].view(b, k + 1)[:, 1:]
            first_pos = g.ints["positions"][:b * (k + 1)].view(b, k + 1)[:, 0]
        else:
            dplan = step.plan
            s = int(dplan.sample_rows.shape[0])
            if s == 0:
                if self.proposer is not None:
                    self.proposer.write_kv(self.backend, step.ctx, dplan.input_ids, hidden,
                                           dplan.query_start_loc, dplan.next_token_ids)
                empty = torch.empty((0, k + 1), dtype=torch.int64, device=hidden.device)
                return StepResult.from_verification(plan.step_id, plan.num_reqs, k, dplan.sample_rows, empty,
                                                    empty[:, 0], None)
            rows, num_drafts = dplan.verify_rows(k + 1)                    # [S, K+1], [S]
            logits = self.model.compute_logits(hidden[rows.reshape(-1)]).view(s, k + 1, -1)
            first_rows, first_pos = rows[:, 0], dplan.positions[rows[:, 0]]
            sample_rows, draft_ids = dplan.sample_rows, dplan.input_ids[rows[:, 1:]]
        # greedy verification reads no sampling tensor: spare their upload
        st = plan.sampling if plan.sampling.all_greedy else plan.sampling.to(self.device)
        tokens, num_sampled = rejection_sample(logits, draft_ids, num_drafts, st, first_pos + 1)
        drafts = None
        if self.proposer is not None:
            last = num_sampled - 1
            last_rows, last_tokens = first_rows + last, tokens.gather(1, last[:, None]).squeeze(1)
            if step.plan is None:
                drafts = self.graphs.propose(last_rows, last_tokens)
            else:
                drafts = self.proposer.propose(self.backend, step.ctx, step.plan.input_ids, hidden,
                                               step.plan.block_tables, step.plan.query_start_loc,
                                               step.plan.next_token_ids, last_rows, last_tokens, sample_rows)
        return StepResult.from_verification(plan.step_id, plan.num_reqs, k, sample_rows, tokens,
                                            num_sampled, drafts)

    def execute(self, plan: StepPlan) -> StepResult:
        """The whole step on a single stage (PP = 1)."""
        hidden, _ = self.forward(plan)
        return self.sample(plan, hidden)
