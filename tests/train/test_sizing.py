"""The sizes train-mtp picks when not told (issue 48: its accelerator defaults on a CPU took one
100-second step of 48 x 320 tokens and 19.7 GB in a 60-second budget, and never left warm-up)."""
from pipespec.train.sizing import (CPU_STEP_TOKENS, CPU_TOKENS_PER_SECOND, MAX_WARMUP, auto_warmup, default_gen_batch,
                                   default_step, default_text_tokens, eval_batch_tokens, expected_memory_bytes,
                                   expected_steps, step_memory_bytes)

# SmolLM2-135M: the target's weights, the head's, the vocabulary
TARGET, HEAD, VOCAB = 134_515_008, 4_205_376, 49_152


def test_cpu_step_fits_a_minute_budget_many_times_over_and_in_4_gb():
    step = default_step("cpu", 60.0)
    assert step.seq_len == 128 and step.tokens < 48 * 320 // 10
    # at the pace of issue 48's machine (48 x 320 tokens in ~100 s) the budget holds 30 steps
    assert 60.0 / (step.tokens / CPU_TOKENS_PER_SECOND) >= 30
    assert expected_memory_bytes(TARGET, HEAD, step.tokens, VOCAB, 3) < 4e9
    # the largest CPU step (no time budget, or a long one) also stays under 4 GB
    for budget in (None, 3600.0):
        big = default_step("cpu", budget)
        assert big.tokens == CPU_STEP_TOKENS[1]
        assert expected_memory_bytes(TARGET, HEAD, big.tokens, VOCAB, 3) < 4e9
    # a tiny budget still gets a step with something to learn from
    assert default_step("cpu", 1.0).tokens >= CPU_STEP_TOKENS[0]
    assert default_step("cpu", 60.0, seq_len=64).seq_len == 64           # --seq-len given: kept


def test_accelerator_keeps_the_recipe_of_the_bundled_head():
    step = default_step("cuda", 3600.0)
    assert (step.batch_size, step.seq_len) == (48, 320)
    assert default_gen_batch("cuda") == 256 and default_gen_batch("cpu") < 64
    assert default_text_tokens("cuda", 60.0) == 2_000_000
    assert default_text_tokens("cpu", 60.0) < 200_000 and default_text_tokens("cpu", None) == 2_000_000


def test_the_memory_estimate_is_led_by_the_logits_and_covers_the_old_defaults_peak():
    # issue 48 measured 19.7 GB at 48 x 320 tokens (chat answers: padded rows hold no per-step logits)
    old = expected_memory_bytes(TARGET, HEAD, 48 * 320, VOCAB, 3)
    assert old > 19.7e9
    assert step_memory_bytes(48 * 320, VOCAB, 3) > 0.9 * old
    # an evaluation batch (the target's logits and one step's at a time) takes no more than a step
    tokens = eval_batch_tokens(512, 3)
    assert tokens >= 512 and 2 * tokens * VOCAB * 4 <= step_memory_bytes(512, VOCAB, 3)
    assert eval_batch_tokens(64, 3) == 1024                         # a few samples a batch, even then


def test_warmup_is_a_share_of_the_steps_the_budget_allows():
    # the old default: 50 warm-up steps, when a 60 s budget held one step
    assert auto_warmup(expected_steps(20_000_000 // (48 * 320), 60.0, 100.0)) == 1
    # a minute at 3 s a step: 20 steps, warm-up 2, done after a tenth of the run
    steps = expected_steps(10_000, 60.0, 3.0)
    assert steps == 20 and auto_warmup(steps) == 2
    # the tokens bound the steps when they come first; long runs keep the recipe's 50
    assert expected_steps(8, 60.0, 3.0) == 8
    assert auto_warmup(expected_steps(100_000, None, None)) == MAX_WARMUP
    # re-estimated part way: what is left of the budget at the pace measured
    assert expected_steps(10_000, 60.0, 3.0, done=10, elapsed=45.0) == 15
    assert expected_steps(10_000, 60.0, 30.0, done=0, elapsed=0.0) == 2
    assert expected_steps(10_000, 1.0, 30.0) == 1                    # at least the one step every run takes
