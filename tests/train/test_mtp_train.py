"""MTP training on tiny random targets: the loop learns, files round-trip, training resumes."""
import json

import pytest
import torch

from pipespec.model.attention import ForwardContext, TorchReferenceBackend, allocate_kv_caches
from pipespec.model.mtp import (META_BASE_CONFIG, META_BASE_MODEL, DeepSeekMTP, load_mtp_file, read_mtp_metadata,
                                save_mtp)
from pipespec.train.data import Batcher, Sample, collate
from pipespec.train.evaluate import agreement
from pipespec.train.forward import chained_mtp, step_mask, target_pass
from pipespec.train import prompts as mp
from pipespec.train.loop import TrainConfig, lr_at, train
from tests.speculative.mtp_tiny import tiny_arch, tiny_head, tiny_target


def _random_samples(n: int, length: int, seed: int, vocab: int = 64) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [Sample(tuple(torch.randint(0, vocab, (length,), generator=g).tolist()), 0) for _ in range(n)]


def test_training_raises_agreement_well_above_chance():
    torch.manual_seed(0)
    target = tiny_target(mixing=0.4)
    heldout = _random_samples(16, 32, seed=99)          # never trained on
    head = DeepSeekMTP(target.arch)
    head.init_from_target(target)
    before = agreement(head, target, heldout, 2, "cpu")
    cfg = TrainConfig(num_steps=2, tokens=8 * 32 * 40, batch_size=8, seq_len=32, lr=1e-2, warmup=5, log_every=20)
    summary = train(head, target, Batcher(_random_samples(128, 32, seed=5), [], 8, 32), cfg, "cpu")
    after = agreement(head, target, heldout, 2, "cpu")
    assert summary["steps"] == 40
    chance = 1 / target.arch.vocab_size
    assert before[0].rate < 0.1
    assert after[0].rate > max(10 * chance, before[0].rate + 0.15), (before, after)
    assert after[1].rate > max(10 * chance, before[1].rate + 0.15), (before, after)   # chained step 2


def test_saved_head_round_trips_names_shapes_metadata_and_outputs(tmp_path):
    target = tiny_target()
    head = tiny_head(target.arch)
    path = tmp_path / "head.safetensors"
    save_mtp(path, head, "tiny-target", extra={"pipespec.train": {"tokens": 123}})
    meta = read_mtp_metadata(path)
    assert meta[META_BASE_MODEL] == "tiny-target"
    assert json.loads(meta[META_BASE_CONFIG])["hidden_size"] == target.arch.hidden_size
    assert json.loads(meta["pipespec.train"]) == {"tokens": 123}
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == {k: tuple(v.shape) for k, v in head.checkpoint_tensors().items()}
    loaded, meta2 = load_mtp_file(path, target.arch)
    assert meta2 == meta
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(3))
    hidden, _ = target_pass(target, ids)
    with torch.no_grad():
        want = chained_mtp(head, target, ids, hidden, 3)
        got = chained_mtp(loaded, target, ids, hidden, 3)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
        torch.testing.assert_close(loaded.compute_logits(g, target.head_weight()),
                                   head.compute_logits(w, target.head_weight()), rtol=0, atol=0)


def test_wider_head_starts_as_the_target_layer_and_round_trips(tmp_path):
    """A head with twice the target's MLP width (`train-mtp --block-intermediate`): initialized from
    the target's last layer it computes what the plain copy computes; its file records the width
    and the target's config, and loads back (as the engine loads a head) to the same outputs."""
    import dataclasses
    target = tiny_target()
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(5))
    hidden, _ = target_pass(target, ids)
    narrow, wide = tiny_head(target.arch), DeepSeekMTP(dataclasses.replace(target.arch, intermediate_size=96))
    narrow.init_from_target(target)
    wide.init_from_target(target)
    wide.load_state_dict({k: v for k, v in narrow.state_dict().items() if not k.startswith("block.")}, strict=False)
    with torch.no_grad():
        for n, w in zip(chained_mtp(narrow, target, ids, hidden, 2), chained_mtp(wide, target, ids, hidden, 2)):
            torch.testing.assert_close(w, n, rtol=1e-5, atol=1e-5)
    assert wide.block.mlp.down_proj.weight[:, 48:].abs().sum() == 0          # the extra columns start at 0
    assert wide.block.mlp.gate_up_proj.weight[48:96].abs().sum() > 0         # the extra gate rows do not
    path = tmp_path / "wide.safetensors"
    save_mtp(path, wide, "tiny-target", base_arch=target.arch)
    meta = read_mtp_metadata(path)
    assert json.loads(meta[META_BASE_CONFIG])["intermediate_size"] == 48
    loaded, _ = load_mtp_file(path, target.arch)
    assert loaded.arch.intermediate_size == 96
    with torch.no_grad():
        for w, g in zip(chained_mtp(wide, target, ids, hidden, 2), chained_mtp(loaded, target, ids, hidden, 2)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="cannot start from the target's 48"):
        DeepSeekMTP(dataclasses.replace(target.arch, intermediate_size=32)).init_from_target(target)


def test_head_file_for_another_model_is_refused(tmp_path):
    target = tiny_target()
    path = tmp_path / "head.safetensors"
    save_mtp(path, tiny_head(target.arch), "tiny-target")
    with pytest.raises(ValueError, match="hidden_size"):
        load_mtp_file(path, tiny_arch(hidden_size=48, head_dim=12))


def test_bf16_file_loads_into_a_paged_inference_step(tmp_path):
    """The saved head runs through the engine's reference backend (what speculative decoding uses)."""
    target = tiny_target()
    path = tmp_path / "head.safetensors"
    save_mtp(path, tiny_head(target.arch), "tiny-target", dtype=torch.bfloat16)
    head, _ = load_mtp_file(path, target.arch, torch.float32)
    arch = target.arch
    ids = torch.tensor([[5, 9, 2, 33, 7, 1]])
    hidden, _ = target_pass(target, ids)
    cache = allocate_kv_caches(1, 4, 4, arch.num_kv_heads, arch.head_dim, torch.float32, "cpu")[0]
    backend = TorchReferenceBackend()
    pos = torch.arange(5)
    attn = backend.prepare(torch.tensor([0, 5]), torch.tensor([5]), pos, torch.arange(4)[None], 4)
    with torch.no_grad():
        paged = head(ForwardContext(pos, pos.clone(), backend, attn, [cache]), ids[0, 1:], hidden[0, :5],
                     embed_weight=target.model.embed_tokens.weight)
        dense = chained_mtp(head, target, ids, hidden, 1)[0][0]
    torch.testing.assert_close(paged, dense, rtol=1e-5, atol=1e-5)


def test_resume_continues_exactly(tmp_path):
    target = tiny_target(mixing=0.4)
    data = Batcher(_random_samples(32, 16, seed=1), _random_samples(8, 16, seed=2), 4, 16, 0.25, seed=3)
    cfg = TrainConfig(num_steps=2, tokens=4 * 16 * 6, batch_size=4, seq_len=16, lr=5e-3, warmup=2,
                      checkpoint=str(tmp_path / "state.pt"), checkpoint_every=3, log_every=100)

    def fresh():
        torch.manual_seed(0)
        return tiny_head(target.arch)

    straight = fresh()
    train(straight, target, data, cfg, "cpu")
    (tmp_path / "state.pt").unlink()
    # a run killed right after its checkpoint at step 3, then resumed to the end
    class Killed(Exception):
        pass

    def kill(step):
        raise Killed(step)

    half = fresh()
    with pytest.raises(Killed):
        train(half, target, data, cfg, "cpu", on_checkpoint=kill)
    resumed = fresh()
    summary = train(resumed, target, data, cfg, "cpu", resume=True)
    assert summary["steps"] == 6
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)
    assert not all(torch.equal(a, b) for a, b in zip(half.state_dict().values(), resumed.state_dict().values()))


def test_batches_are_a_function_of_seed_and_step():
    chat, text = _random_samples(20, 12, seed=1), _random_samples(10, 12, seed=2)
    a = Batcher(chat, text, 8, 16, text_fraction=0.25, seed=7, pad_id=0)
    b = Batcher(chat, text, 8, 16, text_fraction=0.25, seed=7, pad_id=0)
    for step in (5, 0, 3):
        for x, y in zip(a.batch(step), b.batch(step)):
            assert torch.equal(x, y)
    ids, lens, _ = a.batch(0)
    assert ids.shape == (8, 16) and lens.tolist() == [12] * 8
    text_rows = {s.ids for s in text}
    assert sum(tuple(r[:12].tolist()) in text_rows for r in ids) == 2          # 25% of 8 rows
    assert not torch.equal(a.batch(1)[0], a.batch(2)[0])
    # one epoch of the chat pool (20 samples, 6 per batch) visits every chat sample once
    seen = [tuple(r[:12].tolist()) for s in range(3) for r in a.batch(s)[0][:6]]
    assert len(set(seen[:18])) == 18


def test_most_frequent_tokens_counts_answers_only():
    from pipespec.train.data import most_frequent_tokens
    samples = [Sample((9, 9, 9, 1, 1, 2), 3), Sample((5, 2, 2), 1)]     # answers: 1 1 2 and 2 2
    assert most_frequent_tokens(samples, 10, 3).tolist() == [2, 1, 0]  # then ties in id order
    with pytest.raises(ValueError, match="a draft vocabulary holds 1..10 tokens"):
        most_frequent_tokens(samples, 10, 11)


def test_step_mask_counts_answer_rows_like_inference():
    # sequence of 10 tokens, answer starts at index 4: the first draft predicts index 5 (row 3)
    lens, starts = torch.tensor([10]), torch.tensor([4])
    m1 = step_mask(lens, starts, 10, 1)[0]
    m2 = step_mask(lens, starts, 10, 2)[0]
    assert m1.nonzero().flatten().tolist() == [3, 4, 5, 6, 7]     # predicts x_5 .. x_9
    assert m2.nonzero().flatten().tolist() == [3, 4, 5, 6]        # predicts x_6 .. x_9
    ids, lens2, starts2 = collate([Sample((1, 2, 3), 1), Sample((4, 5, 6, 7, 8), 2)])
    assert ids.tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8]]
    assert lens2.tolist() == [3, 5] and starts2.tolist() == [1, 2]


def test_lr_schedule_ends_at_whichever_limit_comes_first():
    cfg = TrainConfig(tokens=100 * 48 * 320, lr=1.0, warmup=10, min_lr_ratio=0.1, max_time=60.0)
    assert cfg.total_steps == 100
    assert lr_at(cfg, 0, 0.0) == pytest.approx(0.1)               # warm-up
    assert 0.9 < lr_at(cfg, 10, 0.0) < 1.0
    assert lr_at(cfg, 50, 30.0) == pytest.approx(0.55)            # half way: cosine midpoint
    assert lr_at(cfg, 50, 60.0) == pytest.approx(0.1)             # time is up: the floor
    assert lr_at(cfg, 100, 1.0) == pytest.approx(0.1)             # steps are up: the floor


def test_heldout_prompts_share_no_prompt_and_no_subject_with_training():
    train_p, held = set(mp.chat_prompts("train")), set(mp.chat_prompts("heldout"))
    assert len(train_p) > 2000 and len(held) > 200
    assert not train_p & held
    sides = {True: 0, False: 0}
    for templates, subjects in ((mp.TOPIC_TEMPLATES, mp.TOPICS), (mp.SKILL_TEMPLATES, mp.SKILLS),
                                (mp.CODE_TEMPLATES, mp.CODE_TASKS), (mp.SENTENCE_TEMPLATES, mp.SENTENCES)):
        for subject in subjects:
            prompts = {t.format(subject) for t in templates}
            # every prompt of a subject sits on one side
            assert prompts <= held or prompts <= train_p, subject
            sides[prompts <= held] += 1
    assert sides[True] > 20 and sides[False] > 5 * sides[True] / 2
    assert mp.chat_prompts("train") == mp.chat_prompts("train")    # deterministic order


def test_everyday_prompts_are_of_kinds_no_template_produces():
    """eval-mtp's everyday set: ten kinds of request, one of each in turn, none a prompt of either
    split nor matching any template of the trainer's."""
    import re
    prompts = mp.everyday_prompts()
    assert len(mp.EVERYDAY) == 10 and len(prompts) == sum(map(len, mp.EVERYDAY.values())) == len(set(prompts))
    assert {next(k for k, v in mp.EVERYDAY.items() if p in v) for p in prompts[:10]} == set(mp.EVERYDAY)
    assert not set(prompts) & (set(mp.chat_prompts("train")) | set(mp.chat_prompts("heldout")))
    templates = [t.replace("{a}", "{}").replace("{b}", "{}") for t in mp.TOPIC_TEMPLATES + mp.SKILL_TEMPLATES
                 + mp.CODE_TEMPLATES + mp.SENTENCE_TEMPLATES + mp.MATH_TEMPLATES]
    patterns = [re.compile(re.escape(t).replace(re.escape("{}"), ".+")) for t in templates]
    assert all(pat.fullmatch(t.replace("{}", "x")) for pat, t in zip(patterns, templates))
    assert not [p for p in prompts if any(pat.fullmatch(p) for pat in patterns)]


def test_eval_mtp_answers_the_prompt_set_it_is_given(default_source):
    """`eval-mtp --prompt-set everyday` scores the target's answers to the everyday requests (and
    `kinds` to the held-out kinds of request)."""
    from pipespec.cli import build_parser
    from pipespec.train.recipe import generate_heldout
    assert build_parser().parse_args(["eval-mtp", "--prompt-set", "everyday"]).prompt_set == "everyday"
    tok = default_source.tokenizer()
    from pipespec.train.request_kinds import kind_prompts
    for prompt_set, want in (("everyday", mp.everyday_prompts()[:2]), ("heldout", mp.chat_prompts("heldout")[:2]),
                             ("kinds", kind_prompts("heldout", 2))):
        samples = generate_heldout(None, default_source.arch, torch.device("cpu"), 2, 4, 2, prompt_set)
        asked = [tok.decode(s.ids[:s.start]) for s in samples]
        assert all(w in a for w, a in zip(want, asked)) and all(len(s.ids) > s.start for s in samples), asked


def test_vocabulary_prompts_mention_no_heldout_subject():
    """Prompts on the default model's vocabulary: thousands of subjects, none a word of a held-out
    subject (checked against the held-out prompts themselves), the same list for the same seed."""
    import re
    from pipespec.checkpoint.source import resolve_model
    tok = resolve_model(None).tokenizer()
    prompts = mp.vocabulary_prompts(tok, 20000)
    assert len(prompts) == 20000 and prompts == mp.vocabulary_prompts(tok, 20000)
    assert prompts != mp.vocabulary_prompts(tok, 20000, seed=1)
    subjects = {p for p in prompts for p in [re.findall(r"[a-z]+", p)[-1]]}
    assert len(subjects) > 10000
    def words(split):
        return {w for p in mp.chat_prompts(split) for w in re.findall(r"[a-z]+", p.lower())}
    only_heldout = words("heldout") - words("train")       # held-out subjects' words, not templates'
    assert len(only_heldout) > 50 and not subjects & only_heldout


def test_samples_files_round_trip_plain_and_gzipped(tmp_path):
    from pipespec.train.data import load_samples, save_samples
    samples = _random_samples(50, 300, seed=3, vocab=49152)
    save_samples(tmp_path / "s.json", samples)
    save_samples(tmp_path / "s.json.gz", samples)
    assert load_samples(tmp_path / "s.json") == samples == load_samples(tmp_path / "s.json.gz")
    # gzipped for real: token ids pack to well under the plain file's size
    assert (tmp_path / "s.json.gz").stat().st_size < (tmp_path / "s.json").stat().st_size / 2


def test_a_data_cache_gives_its_heldout_answers_to_evaluate(tmp_path):
    from pipespec.train.data import load_samples, write_json
    held, chat = _random_samples(3, 20, seed=4), _random_samples(5, 20, seed=5)
    as_json = [{"ids": list(s.ids), "start": s.start} for s in held]
    write_json(tmp_path / "data.json.gz", {"chat": [{"ids": list(s.ids), "start": 0} for s in chat], "text": [],
                                           "heldout": as_json})
    assert load_samples(tmp_path / "data.json.gz") == held
    assert load_samples(tmp_path / "data.json.gz", "chat") == chat
    with pytest.raises(ValueError, match="without a 'check' split"):
        load_samples(tmp_path / "data.json.gz", "check")


def test_cli_has_train_and_eval_subcommands_beside_generate():
    from pipespec.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["train-mtp", "--out", "h.safetensors", "--steps", "2", "--tokens", "1000",
                              "--device", "cpu", "--resume", "--gen-only"])
    assert args.func.__name__ == "_train_mtp"
    assert (args.out, args.steps, args.tokens, args.resume, args.gen_only) == ("h.safetensors", 2, 1000, True, True)
    args = parser.parse_args(["eval-mtp", "--head", "h.safetensors", "--data", "d.json"])
    assert args.func.__name__ == "_eval_mtp" and args.model is None and args.steps is None
    assert parser.parse_args(["generate", "hi"]).func.__name__ == "_generate"
    with pytest.raises(SystemExit):
        parser.parse_args(["train-mtp"])                     # --out is required
