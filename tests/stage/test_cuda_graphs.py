"""CUDA-graph replay against eager execution, and the GPU path against the CPU (GPU only)."""
import pytest

from pipespec import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.default_model]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colours:", "Translate 'cat' to French:"]
KW = dict(device="cuda", dtype="float32", gpu_memory_utilization=0.2, max_num_seqs=8, max_model_len=512)


def _greedy(llm, n=48):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("k", [0, 2])
def test_graph_replay_matches_eager(k):
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    with LLM(speculative_config=spec, enforce_eager=True, **KW) as eager:
        assert eager.engine.executor.stage.graphs is None
        want = _greedy(eager)
    with LLM(speculative_config=spec, **KW) as graphed:
        got = _greedy(graphed)
        graphs = graphed.engine.executor.stage.graphs
        assert graphs.replays > 20, "steady decode steps should replay graphs"
    assert got == want


@pytest.mark.parametrize("k", [0, 2])
def test_async_scheduling_is_on_by_default_and_replays_graphs_with_carried_tokens(k):
    """Two steps in flight, the second embedding the first's tokens (and drafts, its lines moved on
    by the drafts accepted) on the GPU, inside the graph: greedy and seeded output equal the
    synchronous engine's, and every decode step carried."""
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=40, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    outs = []
    for overlap in (False, None):
        with LLM(async_scheduling=overlap, speculative_config=spec, **KW) as llm:
            assert llm.engine.executor.async_scheduling is (overlap is None)
            outs.append((_greedy(llm), [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded, use_tqdm=False)]))
            if overlap is None:
                stats = llm.engine.stats()
                assert llm.engine.executor.stage.graphs.replays > 20
                # (with drafts a request decodes in fewer steps than tokens)
                assert stats["num_carried_rows"] > len(PROMPTS) * 40 / (k + 1), stats
    assert outs[0] == outs[1]


def test_adaptive_k_replays_a_graph_set_per_k_and_matches_eager():
    """A forced K sequence holding each K for several steps: every K in 0..2 replays its own graphs
    (K = 0 included, whose draft graph only writes the MTP KV), and the output is eager's."""
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": True,
            "k_sequence": [2] * 4 + [0] * 4 + [1] * 4}
    with LLM(speculative_config=spec, enforce_eager=True, **KW) as eager:
        want = _greedy(eager)
    with LLM(speculative_config=spec, **KW) as graphed:
        got = _greedy(graphed)
        by_k = graphed.engine.executor.stage.graphs.by_k
        assert sorted(by_k) == [0, 1, 2] and all(g.replays > 3 for g in by_k.values()), \
            {k: g.replays for k, g in by_k.items()}
    assert got == want


@pytest.mark.parametrize("k", [0, 2])
def test_penalties_and_logprobs_are_the_same_with_graphs(k):
    """Greedy with penalties and a logit bias verifies in a graph of its own on the logits a
    processing graph wrote from the forward graph's (no greedy shortcut; with async scheduling the
    carried lines' tokens counted on the GPU); logprobs come from their graph: tokens equal eager's,
    logprobs equal to float tolerance."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=3, repetition_penalty=1.3,
                            presence_penalty=0.5, frequency_penalty=0.2, logit_bias={11: 2.0, 30: -5.0})
    outs = []
    for eager in (True, False):
        with LLM(speculative_config=spec, enforce_eager=eager, **KW) as llm:
            outs.append([o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)])
            if not eager:
                graphs = llm.engine.executor.stage.graphs
                assert graphs.replays > 10 and graphs.logits_replays > 10 and graphs.logprob_replays > 10
                assert graphs.verify_replays == graphs.logits_replays
                assert llm.engine.stats()["num_carried_rows"] > 0
    for e, g in zip(*outs):
        assert e.token_ids == g.token_ids
        for le, lg in zip(e.logprobs, g.logprobs):
            assert le.keys() == lg.keys()
            assert all(abs(le[t].logprob - lg[t].logprob) < 1e-3 for t in le)


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_of_replayed_steps_come_from_their_own_graph(k):
    """Greedy steps (verified inside the forward graph) and sampled ones (in a verification graph) that
    ask for logprobs replay a logprobs graph per bucket and number of top logprobs: the tokens and top
    ids equal eager's, the logprobs to float tolerance."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    asks = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=4),
            SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True, logprobs=1)]
    outs = []
    for eager in (True, False):
        with LLM(speculative_config=spec, enforce_eager=eager, **KW) as llm:
            outs.append([o.outputs[0] for p in asks for o in llm.generate(PROMPTS, p, use_tqdm=False)])
            if not eager:
                graphs = llm.engine.executor.stage.graphs
                assert graphs.logprob_replays > 10 and graphs.logprob_replays <= graphs.replays
                assert graphs.verify_replays > 5
    for e, g in zip(*outs):
        assert e.token_ids == g.token_ids and len(e.logprobs) == len(e.token_ids)
        for le, lg in zip(e.logprobs, g.logprobs):
            assert le.keys() == lg.keys()
            assert all(abs(le[t].logprob - lg[t].logprob) < 1e-3 for t in le)


def test_retired_speculation_replays_graphs_without_the_drafter():
    """Adaptive K retired (forced): K = 0 steps replay the K = 0 set's forward and its finish graph
    without the drafter; the MTP KV is left alone and the output is plain decoding's."""
    import torch
    with LLM(**KW) as plain:
        want = _greedy(plain)
    with LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 2, "adaptive": True}, **KW) as llm:
        llm.engine.k_policy.retired = True
        stage = llm.engine.executor.stage
        mtp_kv = [c.key.clone() for c in stage.drafter.kv_caches]
        got = _greedy(llm)
        assert stage.graphs.by_k[0].replays > 20
        assert all(torch.equal(a, c.key) for a, c in zip(mtp_kv, stage.drafter.kv_caches))
    assert got == want


@pytest.mark.parametrize("k", [0, 3])
def test_sampled_output_is_the_same_with_graphs(k):
    """Seeded sampling (keyed by seed and position) draws the same tokens replayed or eager; replayed
    steps verify in their own graph, one per kind of sampling (top-p sorts, temperature alone and
    min-p do not)."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    asks = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=32, ignore_eos=True),
            SamplingParams(temperature=1.1, min_p=0.05, seed=8, max_tokens=32, ignore_eos=True)]
    outs = []
    for eager in (True, False):
        with LLM(speculative_config=spec, enforce_eager=eager, **KW) as llm:
            outs.append([o.outputs[0].token_ids for p in asks for o in llm.generate(PROMPTS, p, use_tqdm=False)])
            if not eager:
                graphs = llm.engine.executor.stage.graphs
                assert graphs.verify_replays > 20 and graphs.verify_replays <= graphs.replays
                keys = {key[2] for g in graphs.by_k.values() for key in g._verify_graphs}
                assert keys == {True, False}, keys        # sorting and not
    assert outs[0] == outs[1]


def test_padding_requests_leave_live_kv_alone():
    """3 requests replay the batch-4 graph: the padding request must not write any live block."""
    with LLM(**KW) as llm:
        want = _greedy(llm)                       # 5 prompts: the 8-bucket, 3 padding rows
        one = [_greedy_one(llm, p) for p in PROMPTS[:3]]
    assert one == want[:3]


def _greedy_one(llm, prompt, n=48):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.gpu(devices=2)
@pytest.mark.parametrize("k", [0, 2])
def test_pp2_replays_graphs_on_two_devices(k):
    """Stage 1 on cuda:1 captures and replays its graphs there (it used to launch on cuda:0 and
    fail), over NCCL, with the same greedy output as one stage."""
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    with LLM(speculative_config=spec, **KW) as one:
        want = _greedy(one)
    with LLM(speculative_config=spec, pipeline_parallel_size=2, distributed_backend="nccl", **KW) as two:
        assert [st["device"] for st in two.engine.executor.stage_info] == ["cuda:0", "cuda:1"]
        got = _greedy(two)
        assert two.engine.executor.stage.graphs.replays > 20
    assert got == want


def test_long_context_split_kv_graphs_match_eager_and_the_reference_backend():
    """Batch 1 at ~1,500 tokens: the attention kernel splits each program's keys (eagerly by the
    actual block tables, in graphs by the static 4,096-token width, so with other split counts) and
    greedy output equals the unsplit reference attention's."""
    from pipespec.kernels.kv_split import wave_splits
    kw = dict(KW, max_model_len=4096, max_num_batched_tokens=4096)
    prompt = [{"prompt_token_ids": list(range(100, 1600))}]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(attention_backend="torch", enforce_eager=True, **kw) as ref:
        want = ref.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    with LLM(enforce_eager=True, **kw) as eager:
        arch = eager.engine.arch
        assert wave_splits(arch.num_kv_heads, 1504, 132, 128) > 1    # whatever the slots of the GPU
        assert eager.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
    with LLM(**kw) as graphed:
        assert graphed.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == want
        assert graphed.engine.executor.stage.graphs.replays > 10
