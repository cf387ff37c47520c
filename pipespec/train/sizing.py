"""What `pipespec train-mtp` trains with when --batch-size, --seq-len and --warmup are not given, and
the memory a run will take (logged in the plan before anything runs).

A training step's cost and memory are ruled by the vocabulary: the target's logits, their
log-softmax, and per chained step the teacher's probabilities and the head's logits with what their
backward keeps, each [tokens, V] in float32. So the step is sized in tokens:

- on an accelerator, the recipe the bundled head was trained with (48 x 320 tokens);
- on a CPU, a step of `budget * CPU_TOKENS_PER_SECOND / CPU_TARGET_STEPS` tokens, so that a time
  budget holds a few dozen optimizer steps rather than one, within `CPU_STEP_TOKENS` (the upper
  bound keeps the step's memory near `CPU_STEP_MEMORY`).

Warm-up is a share of the steps the run is expected to take (`WARMUP_SHARE`, at most
`MAX_WARMUP`), so a short run finishes it; the loop re-estimates the expected steps from the
first step's measured time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

ACCELERATOR_BATCH, ACCELERATOR_SEQ_LEN = 48, 320
CPU_SEQ_LEN = 128                    # a chat answer's first ~90 tokens after its prompt
# a CPU core pair's training throughput on the default model (48 x 320 tokens took ~100 s on the
# 24 GB machine of issue 48); only the step's size follows from it, the run measures its own speed
CPU_TOKENS_PER_SECOND = 150.0
CPU_TARGET_STEPS = 30                # optimizer steps a CPU time budget should hold at least
CPU_STEP_TOKENS = (256, 1024)        # a CPU step's tokens: at least, at most
WARMUP_SHARE = 0.1
MAX_WARMUP = 50                      # the accelerator recipe's warm-up, reached by runs of 500+ steps
# float32 [tokens, V] tensors alive at a step's peak, per chained step and besides: the teacher's
# logits and log-softmax; per step its probabilities, the head's log-softmax kept for backward,
# and at the last step the head's logits, their gradient and the selected teacher rows
LOGIT_COPIES_PER_STEP, LOGIT_COPIES_BASE = 2, 5
# the interpreter, torch, the tokenizer, the data and the allocator's slack, measured with the
# default model (benchmarks/RESULTS.md, issue 48)
RUNTIME_BYTES = 700 << 20
# an evaluation batch's tokens at least (~400 MB of logits with the default model's vocabulary)
EVAL_MIN_TOKENS = 1024


@dataclass(frozen=True)
class StepSize:
    batch_size: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch_size * self.seq_len


def default_step(device_type: str, max_time: float | None, seq_len: int | None = None) -> StepSize:
    """The step a run trains with when --batch-size is not given (`seq_len`: --seq-len, if given)."""
    if device_type != "cpu":
        n = seq_len or ACCELERATOR_SEQ_LEN
        return StepSize(max(1, ACCELERATOR_BATCH * ACCELERATOR_SEQ_LEN // n), n)
    n = seq_len or CPU_SEQ_LEN
    low, high = CPU_STEP_TOKENS
    tokens = high if max_time is None else CPU_TOKENS_PER_SECOND * max_time / CPU_TARGET_STEPS
    tokens = min(max(tokens, low), high)
    return StepSize(max(1, int(tokens // n)), n)


def auto_warmup(expected_steps: int) -> int:
    """Warm-up steps for a run expected to take `expected_steps`: a share of them, so it ends."""
    return max(1, min(MAX_WARMUP, math.ceil(WARMUP_SHARE * expected_steps)))


def step_memory_bytes(tokens: int, vocab_size: int, num_steps: int) -> int:
    """The float32 [tokens, V] tensors a training step holds at its peak."""
    return (LOGIT_COPIES_BASE + LOGIT_COPIES_PER_STEP * num_steps) * tokens * vocab_size * 4


def eval_batch_tokens(train_tokens: int, num_steps: int) -> int:
    """Tokens per teacher-forced evaluation batch that take no more memory than a training step (an
    evaluation batch holds one [tokens, V] logits tensor at a time, two at its peak), and at least
    `EVAL_MIN_TOKENS`: a few samples a batch, not one (small steps are no reason for slow evaluation)."""
    copies = LOGIT_COPIES_BASE + LOGIT_COPIES_PER_STEP * num_steps
    return max(EVAL_MIN_TOKENS, train_tokens * copies // 2)


def expected_memory_bytes(target_params: int, head_params: int, tokens: int, vocab_size: int,
                          num_steps: int, target_bytes_per_param: int = 4) -> int:
    """Peak resident memory of training: the frozen target, the head with its gradient and AdamW's two
    moments (float32), one step's logits, and the runtime."""
    return (target_params * target_bytes_per_param + 16 * head_params
            + step_memory_bytes(tokens, vocab_size, num_steps) + RUNTIME_BYTES)


def expected_steps(total_steps: int, max_time: float | None, step_seconds: float | None,
                   done: int = 0, elapsed: float = 0.0) -> int:
    """Steps a run will take: `total_steps` (from --tokens), or fewer when the time budget ends it
    first at `step_seconds` a step (`done` steps already taken in `elapsed` seconds)."""
    if not max_time or not step_seconds:
        return total_steps
    return max(1, min(total_steps, done + int(max(0.0, max_time - elapsed) / step_seconds)))


# generation on a CPU: a round small enough that its answers finish (or get far) within a budget of
# a minute, and an engine step of at most this many tokens, so a deadline is kept within seconds
CPU_GEN_BATCH, ACCELERATOR_GEN_BATCH = 8, 256
CPU_GEN_STEP_TOKENS = 256
DEFAULT_TEXT_TOKENS = 2_000_000
# text windows drawn per training token a CPU budget can take (the text share of each batch is
# 25%: a window is seen at most about once)
CPU_TEXT_PER_TRAIN_TOKEN = 10


def default_gen_batch(device_type: str) -> int:
    return CPU_GEN_BATCH if device_type == "cpu" else ACCELERATOR_GEN_BATCH


def default_text_tokens(device_type: str, max_time: float | None) -> int:
    """Text tokens to cut windows from: on a CPU with a time budget, what the budget can use, not
    the 2M an accelerator run learns from (tokenizing them alone took 21 s of a 60 s CPU run)."""
    if device_type != "cpu" or max_time is None:
        return DEFAULT_TEXT_TOKENS
    wanted = CPU_TEXT_PER_TRAIN_TOKEN * CPU_TOKENS_PER_SECOND * max_time
    return int(min(DEFAULT_TEXT_TOKENS, max(20_000, wanted)))
