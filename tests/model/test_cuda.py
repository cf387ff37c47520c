"""GPU checks of the engine core (skipped without CUDA): parity with CPU, memory-sized KV cache."""
import pytest
import torch

from pipespec import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.default_model]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def test_cuda_fp32_greedy_matches_cpu():
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    with LLM(device="cpu") as cpu:
        want = [o.outputs[0].token_ids for o in cpu.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(device="cuda", dtype="float32") as gpu:
        got = [o.outputs[0].token_ids for o in gpu.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want


def test_cuda_defaults_to_bf16_and_sizes_kv_from_free_memory():
    with LLM(device="cuda", gpu_memory_utilization=0.5) as llm:
        runner = llm.engine.executor.stage
        assert runner.dtype == torch.bfloat16
        blocks = llm.engine.scheduler.allocator.num_blocks
        total = torch.cuda.get_device_properties(0).total_memory
        kv_bytes = blocks * runner._bytes_per_block()
        # a 135M model leaves most of half the card to the KV cache, and never more than that half
        assert 0.25 * total < kv_bytes < 0.5 * total
        out = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) >= 1
