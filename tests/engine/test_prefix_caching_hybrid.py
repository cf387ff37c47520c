"""Prefix caching of hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers) end to end, on tiny
real-layout checkpoints with their MTP layer (a gated full-attention block, so its KV is cached by
block like the target's): greedy and seeded outputs with the cache on equal those with it off at
PP = 1 and 2 with MTP K = 1 and 2 (and under async scheduling), the second round of requests
restoring snapshots of the linear-attention states (a restore that copied nothing, or the wrong
state, changes the output); with one snapshot slot, evictions keep the outputs equal; sizing and
switch."""
from __future__ import annotations

import logging

import pytest
import torch

from pipespec import LLM, SamplingParams
from tests.conftest import assert_engine_clean
from tests.model import hybrid_tiny as ht

KWARGS = dict(dtype="float32", device="cpu", max_model_len=160, block_size=16, num_kv_blocks=64,
              max_num_seqs=8, max_num_batched_tokens=24)
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    root = tmp_path_factory.mktemp("prefix-cache-hybrid")
    out = {}
    for kind in ("qwen3_5", "qwen3_next"):
        ht.write(root / kind, kind, tokenizer, num_mtp=1)
        # drafts sometimes accepted, sometimes not; layers mixing enough that the outputs depend on
        # the restored states (a restore that copies nothing changes 2-4 of the 8 outputs)
        ht.make_echo(root / kind, 0.35, 0.175)
        out[kind] = str(root / kind)
    return out


@pytest.fixture(scope="module")
def first_round():
    """Three prompts sharing 40 tokens (two whole blocks and a part)."""
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, ht.VOCAB, (40,), generator=g).tolist()
    return [shared + torch.randint(3, ht.VOCAB, (n,), generator=g).tolist() for n in (3, 11, 20)]


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, seed=5 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
            for i in range(n)]


def _two_rounds(llm: LLM, first_round) -> list[list[int]]:
    """The first round, then each conversation's next turn (its prompt, answer and a new line), a new
    question after the shared 40 tokens, and a repeat of the first prompt cut to two whole blocks
    (which restores nothing: its last block is computed, and no snapshot was taken at 16)."""
    def run(prompts):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(len(prompts)), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    first = run(first_round)
    second = run([p + out + [7, 8, 9] for p, out in zip(first_round, first)]
                 + [first_round[0][:40] + [11, 12, 13, 14, 15], first_round[0][:32]])
    return first + second


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


_REFERENCE: dict[tuple[str, int], list] = {}


def _reference(kind: str, k: int, checkpoints, first_round) -> list:
    """Cache off, PP = 1 (seeded sampling under speculation depends on K)."""
    if (kind, k) not in _REFERENCE:
        with LLM(model=checkpoints[kind], enable_prefix_caching=False, speculative_config=_spec(k), **KWARGS) as llm:
            _REFERENCE[kind, k] = _two_rounds(llm, first_round)
    return _REFERENCE[kind, k]


# (async scheduling: a request's next chunk is planned before the step saving its snapshot returns)
@pytest.mark.parametrize("kind,pp,k,async_", [("qwen3_5", 1, 1, False), ("qwen3_next", 1, 3, False),
                                              ("qwen3_5", 2, 2, False), ("qwen3_next", 3, 3, False),
                                              ("qwen3_5", 1, 2, True)])
def test_cache_on_equals_cache_off_and_snapshots_are_restored(kind, pp, k, async_, checkpoints, first_round):
    expected = _reference(kind, k, checkpoints, first_round)
    with LLM(model=checkpoints[kind], pipeline_parallel_size=pp, check_collectives=pp > 1,
             speculative_config=_spec(k), async_scheduling=async_, **KWARGS) as llm:
        got = _two_rounds(llm, first_round)
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == expected
    cache = stats["prefix_cache"]
    # the first round's prompts were admitted together (nothing cached yet) and saved snapshots at
    # their last block boundary before their last token (32, 48, 48): the next turns and the new
    # question restore them
    assert cache["state_snapshot_restores"] >= 4 and cache["hits"] >= 32 + 48 + 48 + 32, cache
    assert 0.02 < stats["spec_decode"]["draft_acceptance_rate"] < 0.98


def test_evicted_snapshots_keep_outputs_equal(checkpoints, first_round):
    """Two snapshot slots: new saves evict older ones, so most prefixes miss and are recomputed from
    zero state, and those still there restore. (With two slots one of the restored requests' outputs
    depends on its restored state: a restore that copies nothing fails here. With one slot the one
    restore happens to leave its request's output unchanged.)"""
    expected = _reference("qwen3_next", 1, checkpoints, first_round)
    with LLM(model=checkpoints["qwen3_next"], speculative_config=_spec(1), prefix_cache_state_snapshots=2,
             **KWARGS) as llm:
        got = _two_rounds(llm, first_round)
        cache = llm.stats()["prefix_cache"]
        assert_engine_clean(llm)
    assert got == expected
    assert cache["cached_state_snapshots"] == 2 and cache["state_snapshot_saves"] > 2, cache    # evicted
    assert 1 <= cache["state_snapshot_restores"] < 4, cache      # (4 or more with room for all)


def test_on_by_default_with_a_log_line_and_off_with_no_snapshots(caplog, checkpoints):
    with caplog.at_level(logging.INFO, logger="pipespec"):
        with LLM(model=checkpoints["qwen3_5"], prefix_cache_state_snapshots=3, **KWARGS) as llm:
            assert llm.engine.scheduler.state_snapshots.num_blocks == 3 and "prefix_cache" in llm.stats()
            stage = llm.engine.executor.stage
            assert stage.state_snapshots.rec[0].shape[0] == 3
    assert any("3 snapshots" in r.message and "MiB each" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pipespec.engine.llm_engine"):
        with LLM(model=checkpoints["qwen3_5"], prefix_cache_state_snapshots=0, **KWARGS) as llm:
            assert not llm.engine.scheduler.enable_prefix_caching and "prefix_cache" not in llm.stats()
            assert llm.engine.executor.stage.state_snapshots is None
    assert any("prefix caching off" in r.message and "prefix_cache_state_snapshots 0" in r.message
               for r in caplog.records)
    with pytest.raises(ValueError, match="prefix_cache_state_snapshots"):
        LLM(model=checkpoints["qwen3_5"], prefix_cache_state_snapshots=-1, **KWARGS)


@pytest.mark.parametrize("pp", [1, 2])
def test_snapshots_sized_from_memory_take_a_tenth_of_it(pp, checkpoints, first_round):
    """No count given: the snapshots take SNAPSHOT_SHARE of the cache memory and the KV blocks the
    rest; at PP = 2 every stage keeps the least count any stage has room for, and hits restore."""
    from pipespec.model.linear_state import state_bytes
    from pipespec.stage.memory import SNAPSHOT_SHARE
    memory = 2 << 20
    kwargs = dict(KWARGS, num_kv_blocks=None, kv_cache_memory=memory)
    with LLM(model=checkpoints["qwen3_next"], pipeline_parallel_size=pp, check_collectives=pp > 1, **kwargs) as llm:
        sched = llm.engine.scheduler
        snapshots, blocks = sched.state_snapshots.num_blocks, sched.allocator.num_blocks
        _two_rounds(llm, first_round)
        restores = llm.stats()["prefix_cache"]["state_snapshot_restores"]
        if pp == 1:
            stage = llm.engine.executor.stage
            each, per_block = state_bytes(stage._state_shapes(), 1, 0, stage.dtype), stage._bytes_per_block()
            assert snapshots == min(int(SNAPSHOT_SHARE * memory // each), memory // per_block)
            assert blocks == (memory - snapshots * each) // per_block and stage.state_snapshots.rec[0].shape[0] == snapshots
    assert 0 < snapshots < blocks and restores >= 4
    with LLM(model=checkpoints["qwen3_next"], pipeline_parallel_size=pp, enable_prefix_caching=False, **kwargs) as llm:
        assert llm.engine.scheduler.allocator.num_blocks > blocks     # the snapshots' memory is the KV's


def test_cli_flag():
    from pipespec.cli import build_parser, engine_kwargs
    for command in (["generate", "hi"], ["serve"]):
        assert engine_kwargs(build_parser().parse_args(command))["prefix_cache_state_snapshots"] is None
        args = build_parser().parse_args([*command, "--prefix-cache-state-snapshots", "5"])
        assert engine_kwargs(args)["prefix_cache_state_snapshots"] == 5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_on_a_gpu_with_cuda_graphs(kind, checkpoints, first_round):
    """The snapshots' copies on the device, beside states that CUDA graphs read and write: cache on
    equals cache off (both replaying graphs, MTP K = 2), and the second round restored snapshots;
    the snapshots, sized from the measured memory, take at most SNAPSHOT_SHARE of the cache's."""
    from pipespec.model.linear_state import state_bytes
    from pipespec.stage.memory import SNAPSHOT_SHARE
    kw = dict(KWARGS, device="cuda", num_kv_blocks=None, gpu_memory_utilization=0.2)
    runs = {}
    for caching in (False, True):
        with LLM(model=checkpoints[kind], enable_prefix_caching=caching, speculative_config=_spec(2), **kw) as llm:
            runs[caching] = _two_rounds(llm, first_round)
            stats = llm.stats()
            stage = llm.engine.executor.stage
            assert stage.graphs.replays > 0
            if caching:
                n, per_block = llm.engine.scheduler.state_snapshots.num_blocks, stage._bytes_per_block()
                snapshots = n * state_bytes(stage._state_shapes(), 1, 0, stage.dtype)
                assert 0 < n <= stage.num_blocks
                assert snapshots <= SNAPSHOT_SHARE * (stage.num_blocks * per_block + snapshots + per_block)
    assert runs[True] == runs[False]
    assert stats["prefix_cache"]["state_snapshot_restores"] >= 4, stats["prefix_cache"]
