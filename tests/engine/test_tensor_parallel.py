"""Tensor parallelism, composed with pipeline parallelism and MTP, through real processes and gloo.

- Output does not depend on T: greedy and seeded output at TP = 2 equal TP = 1 (tiny Llama-family
  checkpoints whose head counts divide by 2), and at TP = 3 for the default model (SmolLM2-135M:
  9 heads, 3 KV heads; TP = 2 is refused, as vLLM refuses it).
- TP = 2 x PP = 2 with MTP K = 2 equals TP = 1, PP = 1 without speculation (greedy), with the
  collective-symmetry check (TP groups included) on.
- A killed TP rank ends the engine within the stage timeout with an error naming it, and leaves no
  process behind.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.engine.llm_engine import EngineDeadError
from pipespec.runtime.launch import pid_alive
from pipespec.runtime.transport import StageError
from tests.conftest import DEFAULT_LLM_KWARGS
from tests.engine.test_pipeline import TINY_KWARGS, spawned_children

NEW_TOKENS = 10


def _params(n: int) -> list[SamplingParams]:
    """Even requests greedy, odd ones seeded."""
    return [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True) if i % 2 == 0 else
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=77 + i, max_tokens=NEW_TOKENS,
                           ignore_eos=True) for i in range(n)]


def _generate(llm: LLM, prompts) -> list[list[int]]:
    outs = llm.generate(prompts, _params(len(prompts)), use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    lengths = [1, 4, 30, 9]                      # 30 > the 24-token step budget: chunked prefill
    return [{"prompt_token_ids": torch.randint(3, 40000, (n,), generator=g).tolist()} for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tp2_equals_tp1_greedy_and_seeded(tiny_models, prompts, family):
    """llama: untied head, GQA; qwen2: q/k/v bias (sharded with its heads) and a tied head."""
    folder = str(tiny_models[family][0])
    with LLM(model=folder, **TINY_KWARGS) as llm:
        expected = _generate(llm, prompts)
    with LLM(model=folder, tensor_parallel_size=2, check_collectives=True, **TINY_KWARGS) as llm:
        assert len(llm.engine.executor.worker_pids) == 1
        assert _generate(llm, prompts) == expected


def test_tp2_pp2_mtp_k2_equals_tp1_pp1_without_speculation(tiny_llama_head, prompts):
    folder, head = tiny_llama_head
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(model=str(folder), **TINY_KWARGS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    spec = {"method": "mtp", "num_speculative_tokens": 2, "model": str(head)}
    with LLM(model=str(folder), tensor_parallel_size=2, pipeline_parallel_size=2, speculative_config=spec,
             check_collectives=True, **TINY_KWARGS) as llm:
        executor = llm.engine.executor
        assert len(executor.worker_pids) == 3
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        assert got == expected
        assert llm.stats()["spec_decode"]["num_draft_tokens"] > 0
        reports = executor.check_symmetry()     # every TP group issued the same collectives
        assert {k for r in reports.values() for k in r if k.startswith("coll|")} == {"coll|tp0|-1", "coll|tp1|-1"}


def test_default_model_tp3_equals_tp1(_session_llm, tokenizer):
    prompts = [{"prompt_token_ids": tokenizer.encode(t)} for t in ("The capital of France is", "Hi", "1, 1, 2, 3,")]
    expected = _generate(_session_llm, prompts[:3])
    with LLM(model=None, tensor_parallel_size=3, **DEFAULT_LLM_KWARGS) as llm:
        assert _generate(llm, prompts[:3]) == expected


def test_default_model_refuses_tp2_naming_the_heads():
    """Checked in the parent before any worker is spawned: a bad argument (ValueError), said once."""
    before = spawned_children()
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not split the model's attention heads "
                                         r"evenly \(num_attention_heads=9, num_key_value_heads=3\); choose one of 1, 3, 9"):
        LLM(model=None, tensor_parallel_size=2, startup_timeout=60, **DEFAULT_LLM_KWARGS)
    assert spawned_children() <= before


@pytest.mark.serial
@pytest.mark.parametrize("pp, victim", [(1, 1), (2, 3)])
def test_killed_tp_rank_fails_generate_within_timeout(tiny_models, prompts, pp, victim):
    """victim 1: the driver's TP peer on stage 0 (the driver waits in an all-reduce with it);
    victim 3 at PP = 2: TP rank 1 of the last stage (its peer returns the results)."""
    before = spawned_children()
    llm = LLM(model=str(tiny_models["llama"][0]), tensor_parallel_size=2, pipeline_parallel_size=pp,
              stage_timeout=10, **TINY_KWARGS)
    eng = llm.engine
    pids = eng.executor.worker_pids
    pid = pids[victim - 1]
    real_step, calls, killed_at = eng.step, [0], []

    def step():
        calls[0] += 1
        if calls[0] == 3:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
        return real_step()

    eng.step = step
    with pytest.raises(EngineDeadError) as err:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True), use_tqdm=False)
    elapsed = time.monotonic() - killed_at[0]
    assert elapsed < 10, f"the error took {elapsed:.1f}s"
    name = f"pipeline stage {victim // 2} TP rank 1 (rank {victim}) (pid {pid}) killed by SIGKILL"
    assert name in str(err.value), str(err.value)
    # our diagnosis first, what gloo said after it (one line of it, without its advice)
    assert str(err.value).index(name) < str(err.value).index("the driver saw"), str(err.value)
    assert "This is typically" not in str(err.value)
    assert all(o.outputs[0].finish_reason == "abort" for o in err.value.outputs)
    llm.shutdown()
    assert not any(pid_alive(p) for p in pids)
    assert spawned_children() <= before


def test_cli_tensor_parallel_flag(monkeypatch):
    from pipespec.cli import build_parser, engine_kwargs
    from pipespec.config import EngineConfig
    args = build_parser().parse_args(["generate", "-tp", "2", "-pp", "3", "hi"])
    par = EngineConfig.from_kwargs(**engine_kwargs(args)).parallel
    assert (par.tensor_parallel_size, par.pipeline_parallel_size, par.world_size) == (2, 3, 6)
    assert par.custom_all_reduce is False
    args = build_parser().parse_args(["generate", "-tp", "2", "--custom-all-reduce", "hi"])
    assert EngineConfig.from_kwargs(**engine_kwargs(args)).parallel.custom_all_reduce is True
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)


def test_torchrun_launch_tp2_pp2_matches_tp1(tiny_models):
    """4 ranks by torchrun, -tp 2: the pipeline size defaults to WORLD_SIZE / T = 2."""
    import shutil
    import subprocess
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    folder = str(tiny_models["llama"][0])
    prompts = ["Hello there", "The sky is"]
    with LLM(model=folder, **TINY_KWARGS) as llm:
        expected = [o.outputs[0].text for o in
                    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)]
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "pipespec", "--log-level", "WARNING",
           "generate", "-tp", "2", "--model", folder, "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "256", "--num-kv-blocks", "64", "--max-tokens", "8", "--ignore-eos", *prompts]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    texts = [block.split("\n", 1)[1].rsplit("\n### ", 1)[0] for block in run.stdout.split("### prompt: ")[1:]]
    assert texts == expected, run.stdout
