"""The greedy walk over teacher-forced agreement: what an engine drafting K tokens a step gets."""
import pytest
import torch

from pipespec.train.data import Sample, collate
from pipespec.train.evaluate import agreement, agreements, walk
from pipespec.train.forward import target_pass


def test_walk_takes_a_step_per_run_of_accepted_drafts():
    # 12 tokens, the answer from index 2: the first draft comes from row 1, the last token is 11
    assert walk([3] * 12, 2, 12, 3) == (3, 9)       # right every time: 4 tokens a step (the last step cut)
    assert walk([0] * 12, 2, 12, 3) == (9, 9)       # never right: the target's token alone
    assert walk([3] * 12, 2, 12, 1) == (5, 9)       # K caps the run
    # misses cluster: rows 1-6 hard, rows 7-10 easy. A uniform mean over rows 1-10 reads 1 + 9/10 = 1.9
    # tokens a step; the walk takes six one-token steps through the hard stretch, then one of three
    runs = [0] * 7 + [3, 3, 2, 1, 0]
    steps, tokens = walk(runs, 2, 12, 3)
    assert (steps, tokens) == (7, 9) and tokens / steps < 1.3



def test_walk_is_the_engines_acceptance_length(default_source):
    """Greedy decoding with the bundled head and the same answers walked teacher-forced: one figure."""
    from pipespec import LLM, SamplingParams
    from pipespec.heads import bundled_head_path
    from pipespec.model.mtp import load_mtp_file
    from pipespec.train.prompts import chat_prompts
    from pipespec.train.recipe import load_teacher

    k = 2
    llm = LLM(dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": k})
    try:
        tok = llm.get_tokenizer()
        prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": p}]),
                                                   add_special_tokens=False)}
                   for p in chat_prompts("heldout")[:4]]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
        engine = llm.stats()["spec_decode"]["mean_acceptance_length"]
    finally:
        llm.shutdown()
    samples = [Sample(tuple(o.prompt_token_ids) + tuple(o.outputs[0].token_ids), len(o.prompt_token_ids))
               for o in outs]
    target = load_teacher(default_source, "cpu", torch.float32)
    head, _ = load_mtp_file(bundled_head_path(), default_source.arch, torch.float32, "cpu")
    results = agreement(head, target, samples, k, "cpu")
    assert results[-1].walk_length == pytest.approx(engine, abs=0.03), (results, engine)
    assert 1.2 < engine < k + 1                      # the head drafts, and not perfectly


def test_a_draft_vocabulary_restricts_the_heads_choice():
    from pipespec.speculative.draft_vocab import DraftVocab
    from tests.speculative.mtp_tiny import tiny_arch, tiny_head, tiny_target

    target = tiny_target(mixing=0.4)
    head = tiny_head(tiny_arch())
    samples = [Sample(tuple(torch.randint(0, 64, (24,), generator=torch.Generator().manual_seed(i)).tolist()), 4)
               for i in range(6)]
    full = agreement(head, target, samples, 2, "cpu")
    every = agreement(head, target, samples, 2, "cpu", vocab=DraftVocab(torch.arange(64)))
    assert [(r.agree, r.walk_tokens) for r in every] == [(r.agree, r.walk_tokens) for r in full]
    # one token: the head is right only where the target's choice is that token
    teacher = agreement(head, target, samples, 1, "cpu", vocab=DraftVocab(torch.tensor([7])))[0]
    assert teacher.agree < full[0].agree or full[0].agree == 0
    _, logits = target_pass(target, collate(samples)[0])
    assert teacher.agree <= int((logits.argmax(-1) == 7).sum())
    # several vocabularies from one pass (train-mtp's held-out answers with and without its list):
    # each scored as on its own
    small = DraftVocab(torch.arange(0, 64, 3))
    both = agreements(head, target, samples, 2, "cpu", [None, small])
    alone = agreement(head, target, samples, 2, "cpu", vocab=small)
    key = lambda rs: [(r.positions, r.agree, r.chain_agree, r.walk_steps, r.walk_tokens) for r in rs]  # noqa: E731
    assert key(both[0]) == key(full) and key(both[1]) == key(alone) and key(alone) != key(full)
