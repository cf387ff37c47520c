"""Qwen3.5 / Qwen3.5-MoE / Qwen3-Next targets drafting with their own MTP layers (`mtp.*`, a gated
full-attention block, MoE in the MoE models), under pipeline parallelism.

- Greedy with MTP (K = 1..3) equals greedy without it at PP = 1, 2 and 3; the 4 layers are linear /
  full / linear / full, so the splits cut between the two kinds. Drafts are sometimes rejected, so the
  candidate linear-attention state of a verify row that is not the last must be committed on every
  stage (the plan's `state_commit`); committing any other row's state changes the output.
- Seeded sampling with MTP is the same at PP = 1 and 3.
- Wiring: on an echo checkpoint (the target predicts t -> t+1) the MTP module as the format wires it
  drafts t + 2, so acceptance is 100% at PP = 1 and on a last stage without the embedding (PP = 2);
  swapping the concat, skipping the projection or feeding row t its own token (positions misaligned
  by one) drafts t + 1 and acceptance collapses.
"""
from __future__ import annotations


import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.model.moe import SparseMoE
from pipespec.model.qwen3_next import GatedAttention
from tests.conftest import assert_engine_clean
from tests.model import hybrid_tiny as ht

KWARGS = dict(dtype="float32", device="cpu", max_model_len=128, block_size=16, num_kv_blocks=32,
              max_num_seqs=8, max_num_batched_tokens=24)
MAX_TOKENS = 12


def _spec(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer):
    """{(kind, mixing): folder}: mixing 0.2 (drafts often but not always right) and 0 (pure echo)."""
    root = tmp_path_factory.mktemp("qwen3-next-mtp")
    out = {}
    for kind in ht.KINDS:
        for mixing in (0.2, 0.0):
            folder = root / f"{kind}-{mixing}"
            ht.write(folder, kind, tokenizer, num_mtp=1)
            ht.make_echo(folder, mixing, mixing / 2)
            out[kind, mixing] = str(folder)
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(2)
    return [{"prompt_token_ids": torch.randint(3, ht.VOCAB, (n,), generator=g).tolist()} for n in (5, 23, 11, 40)]


def _generate(llm: LLM, prompts, params=None) -> list[list[int]]:
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def references(checkpoints, prompts):
    out = {}
    for kind in ht.KINDS:
        with LLM(model=checkpoints[kind, 0.2], **KWARGS) as llm:
            out[kind] = _generate(llm, prompts)
    return out


# every kind at PP = 1 for each K; PP = 2 and 3 on a spread of kinds, K and splits (each PP run spawns
# workers): "1,3" leaves stage 0 a single linear-attention layer; PP runs check collective symmetry (I3)
CASES = [(kind, 1, k, None) for kind in ht.KINDS for k in (1, 2, 3)] + [
    ("qwen3_5", 2, 2, "1,3"), ("qwen3_next", 2, 3, None), ("qwen3_5_moe", 3, 3, None), ("qwen3_next", 3, 1, None)]


@pytest.mark.parametrize("kind,pp,k,partition", CASES)
def test_greedy_with_mtp_equals_greedy_without(kind, pp, k, partition, checkpoints, prompts, references):
    with LLM(model=checkpoints[kind, 0.2], pipeline_parallel_size=pp, pp_layer_partition=partition,
             check_collectives=pp > 1, speculative_config=_spec(k), **KWARGS) as llm:
        if pp == 1:
            layer = llm.engine.executor.stage.drafter.layers[0]
            assert isinstance(layer.block.self_attn, GatedAttention)
            assert isinstance(layer.block.mlp, SparseMoE) == (kind != "qwen3_5")
        got = _generate(llm, prompts)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == references[kind]
    # some drafts accepted and some rejected: steps commit candidate states other than the first and last
    assert 0.02 < stats["draft_acceptance_rate"] < 0.98


@pytest.mark.parametrize("pp", [1, 2])
def test_adaptive_k_keeps_linear_states_right_across_k_changes(pp, checkpoints, prompts, references):
    """Adaptive K: a K = 0 step after a verify step must still commit the candidate state the plan
    names, and a K = 2 step after a K = 0 one has none to commit; the forced K sequence passes through
    every such change, and greedy output stays that of plain decoding."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": True, "k_sequence": [2, 0, 1, 0, 2, 2]}
    with LLM(model=checkpoints["qwen3_next", 0.2], pipeline_parallel_size=pp, check_collectives=pp > 1,
             speculative_config=spec, **KWARGS) as llm:
        got = _generate(llm, prompts)
        stats = llm.stats()["spec_decode"]
        assert_engine_clean(llm)
    assert got == references["qwen3_next"]
    assert all(n > 0 for n in stats["adaptive_k"]["k_steps"])
    assert 0.02 < stats["draft_acceptance_rate"] < 0.98


@pytest.mark.parametrize("kind,spec", [(kind, _spec(2)) for kind in ht.KINDS] + [
    ("qwen3_next", {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True, "k_sequence": [3, 3, 0, 1, 0, 2, 2]})])
def test_async_scheduling_commits_the_carried_candidate_state(kind, spec, checkpoints, prompts, references):
    """Steps continued before the verify step ahead returns: the device fills in the drafts, moves
    the line on by the drafts accepted and commits that step's candidate linear-attention state (its
    accepted count, which the host does not know yet). Greedy output stays that of plain decoding."""
    with LLM(model=checkpoints[kind, 0.2], async_scheduling=True, speculative_config=spec, **KWARGS) as llm:
        got = _generate(llm, prompts)
        stats = llm.stats()
        assert_engine_clean(llm)
    assert got == references[kind]
    assert stats["num_carried_rows"] > 0 and 0.02 < stats["spec_decode"]["draft_acceptance_rate"] < 0.98


def test_seeded_sampling_with_mtp_is_the_same_at_every_pipeline_size(checkpoints, prompts):
    params = [SamplingParams(temperature=0.8, top_k=20, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
              for i in range(len(prompts))]
    outs = []
    for pp in (1, 3):
        with LLM(model=checkpoints["qwen3_next", 0.2], pipeline_parallel_size=pp, speculative_config=_spec(2),
                 **KWARGS) as llm:
            outs.append(_generate(llm, prompts, params))
    assert outs[0] == outs[1]


def _acceptance(folder: str, prompts, pp: int = 1, rewire=None, misalign: bool = False) -> float:
    with LLM(model=folder, pipeline_parallel_size=pp, speculative_config=_spec(3), **KWARGS) as llm:
        drafter = llm.engine.executor.stage.drafter if pp == 1 else None
        if rewire is not None:
            drafter.layers[0].combine = rewire(drafter.layers[0])
        if misalign:          # row t gets its own token x_t instead of x_{t+1}
            buffers = llm.engine.executor.stage.buffers
            write, real, step = buffers.write, drafter.propose, {}

            def record(plan, pad_to=None):
                step["input"] = inp = write(plan, pad_to)
                return inp

            def propose(ctx, mtp_input_ids, line_tables, hidden, last_rows, last_tokens, *k):
                ids = step["input"].input_ids
                return real(ctx, ids, line_tables, hidden, last_rows, ids[last_rows], *k)
            buffers.write, drafter.propose = record, propose
        _generate(llm, prompts)
        return llm.stats()["spec_decode"]["draft_acceptance_rate"]


def _swapped(layer):
    s = layer.shared
    return lambda e, h: s.fc(torch.cat([s.pre_fc_norm_hidden(h), s.pre_fc_norm_embedding(e)], dim=-1))


def _no_projection(layer):
    return lambda e, h: layer.shared.pre_fc_norm_hidden(h)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_mtp_wiring_drafts_two_ahead(kind, checkpoints, prompts):
    folder = checkpoints[kind, 0.0]
    assert _acceptance(folder, prompts) == 1.0
    assert _acceptance(folder, prompts, pp=2) == 1.0        # the last stage applies the projection too
    for rewire in (_swapped, _no_projection):
        assert _acceptance(folder, prompts, rewire=rewire) < 0.1, rewire.__name__
    assert _acceptance(folder, prompts, misalign=True) < 0.1


def test_preemption_while_speculating_changes_nothing(checkpoints, prompts, references):
    """5 KV blocks for four requests: some are preempted with a verify step's candidate states
    uncommitted; their slots are freed and they restart from position 0 or a restored snapshot."""
    kwargs = dict(KWARGS, max_model_len=64, num_kv_blocks=5)
    with LLM(model=checkpoints["qwen3_next", 0.2], pipeline_parallel_size=2, speculative_config=_spec(2),
             **kwargs) as llm:
        got = _generate(llm, prompts)
        assert llm.engine.scheduler.num_preemptions > 0
        assert_engine_clean(llm)
    assert got == references["qwen3_next"]
