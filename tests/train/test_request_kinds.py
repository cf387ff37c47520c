"""Requests of many kinds, requests the target writes itself, and second turns (issue 49)."""
import re

import pytest
import torch

from pipespec.train import prompts as mp
from pipespec.train import request_kinds as rk


def _kind_of(prompt: str) -> str:
    """The kind whose phrasing the prompt fills (exactly one must fit)."""
    fits = {k for k, phrasings in rk.KINDS.items() for p in phrasings
            if re.fullmatch(re.escape(p).replace(re.escape("{}"), ".+"), prompt)}
    assert len(fits) == 1, (prompt, fits)
    return fits.pop()


def test_heldout_kinds_are_apart_from_training_kinds_and_ask_about_training_subjects():
    train_k, held_k = set(rk.kinds("train")), set(rk.kinds("heldout"))
    assert held_k == set(rk.HELDOUT_KINDS) and not train_k & held_k and train_k | held_k == set(rk.KINDS)
    train_p, held_p = rk.kind_prompts("train"), rk.kind_prompts("heldout")
    assert not set(train_p) & set(held_p)
    assert {_kind_of(p) for p in held_p[:200]} == held_k
    # every kind in turn: the first N of either split mix all its kinds
    assert {_kind_of(p) for p in train_p[:len(train_k)]} == train_k
    assert {_kind_of(p) for p in held_p[:len(held_k)]} == held_k
    # subjects: the training split's only, so the held-out kinds differ from training in kind alone
    subjects = set(rk.training_subjects())
    heldout_subjects = {s for s in mp.TOPICS + mp.SKILLS if mp.held_out(s)}
    assert heldout_subjects and not subjects & heldout_subjects
    for p in held_p[:300] + train_p[:300]:
        assert any(p == phrasing.format(s) for phrasing in rk.KINDS[_kind_of(p)] for s in subjects), p
    assert rk.kind_prompts("train", 50, seed=1) == rk.kind_prompts("train", 50, seed=1) \
        != rk.kind_prompts("train", 50, seed=2)
    with pytest.raises(ValueError, match="split"):
        rk.kinds("test")


def test_everyday_requests_fill_no_kind_phrasing():
    """The everyday set stays written apart from everything the trainer asks."""
    patterns = [re.compile(re.escape(p).replace(re.escape("{}"), ".+")) for ps in rk.KINDS.values() for p in ps]
    assert not [p for p in mp.everyday_prompts() if any(pat.fullmatch(p) for pat in patterns)]


def test_writing_prompts_list_training_kinds_and_leave_the_next_item_open():
    prompts = rk.writing_prompts(20, examples=3, seed=4)
    assert len(prompts) == 20 and len(set(prompts)) == 20 and prompts == rk.writing_prompts(20, examples=3, seed=4)
    for text in prompts:
        head, *items, last = text.split("\n")
        assert last == "-" and len(items) == 3 and all(i.startswith("- ") for i in items)
        assert all(_kind_of(i[2:]) in rk.kinds("train") for i in items)


@pytest.mark.parametrize("text, want", [
    (" Write a story about a tree.\n- next", "Write a story about a tree."),
    (' "How do I fix a flat bicycle tyre?"', "How do I fix a flat bicycle tyre?"),
    ("", None),                                     # nothing written
    ("10 Fun facts to add on the final line.", None),  # not a sentence's start
    (" Have fun, laddling by:", None),              # no sentence's end
    (" Hi.", None),                                 # too short to be a request
])
def test_parse_written_keeps_lines_that_read_as_a_request(text, want):
    assert rk.parse_written(text) == want


def test_written_requests_and_second_turns_come_from_the_target(llm, tokenizer):
    """The target continues the lists with requests of its own; a second turn's sample holds the
    first turn's request and answer, a follow-up, and the target's answer to it."""
    from pipespec.train.data import two_turn_samples, written_requests
    written = written_requests(llm, 8, round_size=8, seed=0)
    assert written and len(set(written)) == len(written)
    assert all(rk.parse_written(w) == w for w in written)
    assert not set(written) & set(rk.kind_prompts("train"))       # its own, not a copied example

    asked = ["Write a poem about rivers.", "Tell me a joke about trains."]
    samples = two_turn_samples(llm, asked, max_tokens=6, round_size=2, seed=0)
    assert len(samples) == 4
    firsts, seconds = samples[:2], samples[2:]
    for prompt, first, second in zip(asked, firsts, seconds):
        first_answer = tokenizer.decode(first.ids[first.start:], skip_special_tokens=True)
        context = tokenizer.decode(second.ids[:second.start])
        assert prompt in tokenizer.decode(first.ids[:first.start]) and len(first.ids) > first.start
        assert prompt in context and first_answer.strip() in context
        assert any(f in context for f in rk.FOLLOW_UPS) and len(second.ids) > second.start


def test_train_mtp_data_mixes_every_source_and_holds_out_kinds(default_source):
    """build_data with every new source on: held-out kinds' answers in a split of their own, and
    training answers to kind prompts, written requests and a second turn."""
    from pipespec.cli import build_parser
    from pipespec.train.recipe import build_data
    args = build_parser().parse_args(
        ["train-mtp", "--out", "x", "--gen-prompts", "0", "--kind-prompts", "3", "--written-prompts", "2",
         "--follow-ups", "1", "--heldout-prompts", "1", "--heldout-kind-prompts", "2", "--gen-max-tokens", "4",
         "--gen-batch", "4", "--gen-temperatures", "0", "--text-tokens", "0"])
    data = build_data(args, default_source, torch.device("cpu"))
    tok = default_source.tokenizer()
    asked = {split: [tok.decode(s.ids[:s.start]) for s in data[split]] for split in data if split != "text"}
    assert len(asked["heldout"]) == 1 and len(asked["heldout_kinds"]) == 2
    assert all(any(p in a for p in rk.kind_prompts("heldout", 2)) for a in asked["heldout_kinds"])
    second = [a for a in asked["chat"] if any(f in a for f in rk.FOLLOW_UPS)]
    kind = [a for a in asked["chat"] if any(p in a for p in rk.kind_prompts("train", 3)) and a not in second]
    # three kind prompts and the written requests answered once each, one of them twice (two turns)
    assert len(second) == 1 and len(kind) == 3 and len(asked["chat"]) >= 3 + 1 + 1, asked["chat"]
    assert len(asked["chat"]) == len(set(asked["chat"]))
