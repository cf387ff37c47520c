"""What the last stage needs to process a step's logits (`pipespec.sampling.apply_penalties`), built by
the driver from the request state it owns (I1): each sampling line's penalties, its tokens' counts
before the line's first row, and per-row biases and bans. Bans that depend on the tokens before a row
(min_tokens, bad words) are worked out here for every verify row, the line's drafts included, since
the driver knows the drafts it sends: a row's output is used only when every draft before it is."""
from __future__ import annotations

from pipespec.engine.host_tensors import float32_tensor, int64_tensor
from pipespec.engine.request import Request

_BANNED = float("-inf")


def bad_words_token_ids(tokenizer, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
    """Each bad word as the model would spell it, alone and after a space (as vLLM does)."""
    seqs = []
    for word in words or ():
        for text in (word, " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return tuple(seqs)


def logits_inputs(samplers: list[Request], drafts: list[list[int]], num_rows: int) -> dict:
    """StepPlan fields (`penalties`, `penalty_tokens`, `bias_entries`, `bias_values`) for sampling
    lines `samplers` verifying `drafts` (each line's real drafts), lines of `num_rows` = 1 + K rows;
    empty when no sampler adjusts its logits."""
    if not any(r.params.adjusts_logits for r in samplers):
        return {}
    pen, tokens, entries, values = [], [], [], []
    any_penalty = False
    for s, (req, line_drafts) in enumerate(zip(samplers, drafts)):
        p = req.params
        pen += (p.repetition_penalty, p.presence_penalty, p.frequency_penalty)
        if p.penalized:
            any_penalty = True
            counts = req.output_counts
            prompt = req.prompt_set if p.repetition_penalty != 1.0 else ()
            for t, c in counts.items():
                tokens += (s, t, c, t in prompt)
            for t in prompt:
                if t not in counts:
                    tokens += (s, t, 0, 1)
        for t, b in (p.logit_bias or {}).items():
            entries += (s, t, 0, num_rows)
            values.append(b)
        left = p.min_tokens - req.num_output_tokens
        if left > 0:
            for t in req.eos_ids | req.stop_ids:
                entries += (s, t, 0, left)
                values.append(_BANNED)
        if req.bad_words_ids:
            out = req.token_ids[req.num_prompt_tokens:]
            for seq in req.bad_words_ids:
                if len(seq) == 1:
                    entries += (s, seq[0], 0, num_rows)
                    values.append(_BANNED)
                    continue
                prefix = list(seq[:-1])
                for j in range(len(line_drafts) + 1):       # row j follows the first j drafts
                    ctx = out + line_drafts[:j] if j else out
                    if len(ctx) >= len(prefix) and ctx[len(ctx) - len(prefix):] == prefix:
                        entries += (s, seq[-1], j, j + 1)
                        values.append(_BANNED)
    fields = {"bias_entries": int64_tensor(entries).view(-1, 4), "bias_values": float32_tensor(values)}
    if any_penalty:
        fields["penalties"] = float32_tensor(pen).view(-1, 3)
        fields["penalty_tokens"] = int64_tensor(tokens).view(-1, 4)
    return fields
