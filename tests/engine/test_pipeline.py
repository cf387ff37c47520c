"""Pipeline parallelism across processes (gloo on CPU).

- Outputs do not depend on the pipeline size: greedy for PP = 1, 2, 3 on SmolLM2 and on a tiny random
  Llama, with requests arriving at different steps and prompts longer than the step budget (chunked
  prefill); seeded sampling for PP = 1 and 2.
- Each stage holds only its slice (parameter counts) and reads only its tensors from the checkpoint.
- The collective-symmetry check (PIPESPEC_CHECK_COLLECTIVES=1) passes on a normal run.
- Failures end at the driver, in time, with every process gone: a killed worker, a frozen worker, a
  stage that fails to load, Ctrl-C. And the torchrun launch gives the same text.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from pipespec import LLM, SamplingParams
from pipespec.engine.llm_engine import EngineDeadError
from pipespec.runtime.launch import pid_alive
from pipespec.runtime.transport import StageError
from tests.conftest import DEFAULT_LLM_KWARGS
from tests.helpers import sigint_as_in_a_terminal, started_processes

NEW_TOKENS = 8
ARRIVALS = [0, 0, 1, 2, 3, 4, 6, 8]          # all within the first requests' 8 decodes

_STORY = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a lamp, a "
          "logbook and a thermos of tea. From the gallery he could see the fishing boats returning and "
          "the gulls circling the harbour. ")
TEXTS = [
    "Hi",
    "The capital of France is",
    "Here is a list of fruits: apple, banana,",
    _STORY + "One night, the lamp",
    "def add(a, b):\n",
    "Question: Why is the sky blue?\nAnswer:",
    (_STORY * 2) + "He wrote in the logbook:",
    "1, 1, 2, 3, 5, 8,",
]

TINY_KWARGS = dict(dtype="float32", device="cpu", max_model_len=256, block_size=16, num_kv_blocks=128,
                   max_num_seqs=16, max_num_batched_tokens=24)


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def seeded(i: int):
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=4321 + i, max_tokens=NEW_TOKENS,
                          ignore_eos=True)


def run_staggered(llm, prompts, params) -> list[list[int]]:
    """Prompt i arrives at step ARRIVALS[i]; returns each request's output ids."""
    eng = llm.engine
    done: dict[str, list[int]] = {}
    step = most_running = 0
    while len(done) < len(prompts):
        for i, at in enumerate(ARRIVALS):
            if at == step:
                eng.add_request(f"pp-{i}", prompts[i], params[i])
        for out in eng.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length" and out.error is None
                done[out.request_id] = out.outputs[0].token_ids
        most_running = max(most_running, len(eng.scheduler.running))
        step += 1
        assert step < 1000
    assert most_running >= 6, f"requests barely overlapped ({most_running} at most)"
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.allocator.num_free == eng.scheduler.allocator.num_blocks
    return [done[f"pp-{i}"] for i in range(len(prompts))]


def spawned_children() -> set[int]:
    """Live processes this process started (stage workers among them), not its multiprocessing helpers."""
    return started_processes(os.getpid())


def make_llm(model, pp: int, check: bool = False, **kwargs) -> LLM:
    return LLM(model=model, pipeline_parallel_size=pp, check_collectives=check, **kwargs)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert max(len(x) for x in ids) > DEFAULT_LLM_KWARGS["max_num_batched_tokens"]   # chunked prefill
    return [{"prompt_token_ids": x} for x in ids]


@pytest.fixture(scope="module")
def smol_pp2():
    """SmolLM2 in 2 stages, with the collective-symmetry check on."""
    llm = make_llm(None, 2, check=True, **DEFAULT_LLM_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def smol_pp3():
    llm = make_llm(None, 3, **DEFAULT_LLM_KWARGS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def smol_greedy_pp1(_session_llm, prompts):
    return run_staggered(_session_llm, prompts, [greedy()] * len(prompts))


# -- outputs do not depend on the pipeline ------------------------------------------------------


def test_greedy_smollm2_same_for_pp_1_2_3(llm, smol_greedy_pp1, smol_pp2, smol_pp3, prompts):
    assert all(len(x) == NEW_TOKENS for x in smol_greedy_pp1)
    for pp, engine in ((2, smol_pp2), (3, smol_pp3)):
        assert engine.engine.executor.max_in_flight == pp
        got = run_staggered(engine, prompts, [greedy()] * len(prompts))
        for i, (a, b) in enumerate(zip(smol_greedy_pp1, got)):
            assert a == b, f"PP={pp}, prompt {i}: {b} != PP=1 {a}"


def test_seeded_sampling_smollm2_same_for_pp_1_2(llm, smol_pp2, prompts, smol_greedy_pp1):
    params = [seeded(i) for i in range(len(prompts))]
    pp1 = run_staggered(llm, prompts, params)
    pp2 = run_staggered(smol_pp2, prompts, params)
    assert pp1 == pp2
    assert sum(a != b for a, b in zip(pp1, smol_greedy_pp1)) >= 4     # it really sampled


def test_micro_batches_overlap(smol_pp2, prompts):
    """Two micro-batches in flight, each with about half of the running requests."""
    eng = smol_pp2.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"mb-{i}", p, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    in_flight_sizes = []
    while eng.has_unfinished_requests():
        eng.step()
        in_flight_sizes.append([len(b.requests) for b in eng._in_flight])
        ids = [r.request_id for b in eng._in_flight for r in b.requests]
        assert len(ids) == len(set(ids)), "a request is in two micro-batches at once"
    assert max(len(s) for s in in_flight_sizes) == 1          # one left in flight after each step...
    assert any(s and s[0] == 4 for s in in_flight_sizes)      # ...holding half of the 8 requests


def test_scheduler_splits_running_requests_among_micro_batches():
    from pipespec.config import SchedulerConfig
    from pipespec.engine.scheduler import Scheduler
    from tests.helpers import make_request

    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16), 16, 64, 256,
                      num_micro_batches=2)
    for i in range(7):
        sched.add(make_request(f"r{i}", [1 + i] * (3 + i)))
    first, second = sched.schedule(), sched.schedule()
    assert [len(first.requests), len(second.requests)] == [4, 3]        # ceil(7 / 2), then the rest
    assert not {r.request_id for r in first.requests} & {r.request_id for r in second.requests}
    assert sched.schedule() is None                # everything is in flight: nothing to add
    sched.complete(first)
    for req in first.requests:
        req.token_ids.append(9)
    again = sched.schedule()                       # the first micro-batch's requests, decoding
    assert [r.request_id for r in again.requests] == [r.request_id for r in first.requests]
    assert again.plan.num_tokens == 4


def test_collective_symmetry_holds_on_a_normal_run(smol_pp2, prompts):
    smol_pp2.generate(prompts[:3], greedy(), use_tqdm=False)
    reports = smol_pp2.engine.executor.check_symmetry()
    assert set(reports) == {0, 1}
    sent_acts = reports[0]["send|data|1"][0]
    assert sent_acts > 0 and sent_acts == reports[1]["recv|data|0"][0]
    assert reports[1]["send|ctrl|0"][0] == reports[0]["recv|ctrl|1"][0] > 0     # results


@pytest.fixture(scope="module")
def tiny_llama(tiny_models):
    return tiny_models["llama"][0]


@pytest.fixture(scope="module")
def tiny_prompts():
    g = torch.Generator().manual_seed(7)
    lengths = [1, 3, 7, 30, 5, 60, 2, 11]          # 30 and 60 > the 24-token step budget
    return [{"prompt_token_ids": torch.randint(3, 40000, (n,), generator=g).tolist()} for n in lengths]


def test_greedy_tiny_model_same_for_pp_1_2_3(tiny_llama, tiny_prompts):
    outs = {}
    for pp in (1, 2, 3):
        with LLM(model=str(tiny_llama), pipeline_parallel_size=pp, **TINY_KWARGS) as llm:
            assert llm.engine.layer_ranges == [[(0, 3)], [(0, 2), (2, 3)], [(0, 1), (1, 2), (2, 3)]][pp - 1]
            outs[pp] = run_staggered(llm, tiny_prompts, [greedy()] * len(tiny_prompts))
    assert outs[1] == outs[2] == outs[3]
    assert len({tuple(x) for x in outs[1]}) == len(tiny_prompts)


# -- each stage holds its slice -----------------------------------------------------------------


def test_stage_parameter_counts(llm, smol_pp2, smol_pp3):
    full = llm.engine.executor.stage.model
    total = sum(p.numel() for p in full.parameters())
    per_layer = sum(p.numel() for p in full.model.layers["0"].parameters())
    embed = full.model.embed_tokens.weight.numel()
    norm = full.model.norm.weight.numel()
    assert full.arch.tie_word_embeddings        # the last stage keeps its own copy of the head
    for engine in (smol_pp2, smol_pp3):
        info = engine.engine.executor.stage_info
        ranges = engine.engine.layer_ranges
        assert len(info) == len(ranges) and len({st["pid"] for st in info}) == len(ranges)
        for st, (a, b) in zip(info, ranges):
            expected = (b - a) * per_layer + (embed if a == 0 else 0) + (norm + embed if b == 30 else 0)
            assert st["num_params"] == expected, (st, a, b)
        # the layers are split, not copied: only the tied head is held twice
        assert sum(st["num_params"] for st in info) == total + embed
        assert max(st["num_params"] for st in info) < 0.65 * total
    assert smol_pp3.engine.executor.stage_info[1]["num_params"] < 0.3 * total   # a middle stage: layers only


def test_each_stage_reads_only_its_tensors(tiny_llama, monkeypatch):
    from pipespec.config import EngineConfig
    from pipespec.stage import Stage
    from pipespec.checkpoint.source import resolve_model
    from pipespec.model.weights import SafetensorsSource

    read: list[str] = []
    original, original_slice = SafetensorsSource.get, SafetensorsSource.get_slice
    monkeypatch.setattr(SafetensorsSource, "get", lambda self, name: read.append(name) or original(self, name))
    # column-parallel layers (fused q/k/v, gate/up) read their rows through lazy slices
    monkeypatch.setattr(SafetensorsSource, "get_slice",
                        lambda self, name: read.append(name) or original_slice(self, name))
    source = resolve_model(str(tiny_llama))
    config = EngineConfig.from_kwargs(model=str(tiny_llama), dtype="float32", device="cpu", num_kv_blocks=4)
    per_stage = []
    for layers in ((0, 1), (1, 2), (2, 3)):
        read.clear()
        Stage(source, config, layers, 64)
        per_stage.append(set(read))
    everything = set(source.weights().names())
    assert set().union(*per_stage) == everything
    assert all(not (a & b) for i, a in enumerate(per_stage) for b in per_stage[i + 1:])
    assert "model.embed_tokens.weight" in per_stage[0]
    assert {"lm_head.weight", "model.norm.weight"} <= per_stage[2]
    for i, names in enumerate(per_stage):
        layers = {n.split(".")[2] for n in names if n.startswith("model.layers.")}
        assert layers == {str(i)}, (i, sorted(names))


# -- failures end at the driver, in time, with nothing left running ------------------------------


@pytest.mark.serial
def test_killed_worker_fails_generate_within_timeout(tiny_llama, tiny_prompts):
    before = spawned_children()
    llm = LLM(model=str(tiny_llama), pipeline_parallel_size=3, stage_timeout=10, **TINY_KWARGS)
    executor = llm.engine.executor
    pids = executor.worker_pids
    assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    eng = llm.engine
    real_step, calls, killed_at = eng.step, [0], []

    def step():
        calls[0] += 1
        if calls[0] == 3:                       # mid-generation: kill the middle stage
            os.kill(pids[0], signal.SIGKILL)
            killed_at.append(time.monotonic())
        return real_step()

    eng.step = step
    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    with pytest.raises(EngineDeadError) as err:
        llm.generate(tiny_prompts[:4], params, use_tqdm=False)
    elapsed = time.monotonic() - killed_at[0]
    assert elapsed < 10, f"the error took {elapsed:.1f}s"
    msg = str(err.value)
    assert f"pipeline stage 1 (pid {pids[0]}) killed by SIGKILL" in msg, msg
    aborted = err.value.outputs
    assert len(aborted) == 4 and all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    assert all(o.error and "pipeline stage 1" in o.error for o in aborted)
    assert not any(pid_alive(p) for p in pids)
    assert spawned_children() <= before
    assert not eng.has_unfinished_requests()
    with pytest.raises(EngineDeadError):
        llm.generate(tiny_prompts[:1], params, use_tqdm=False)
    llm.shutdown()


@pytest.mark.serial
def test_frozen_worker_fails_within_stage_timeout(tiny_llama, tiny_prompts):
    before = spawned_children()
    llm = LLM(model=str(tiny_llama), pipeline_parallel_size=2, stage_timeout=2, **TINY_KWARGS)
    eng = llm.engine
    pid = eng.executor.worker_pids[0]
    for i, p in enumerate(tiny_prompts[:3]):
        eng.add_request(f"f-{i}", p, SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))
    eng.step()
    os.kill(pid, signal.SIGSTOP)               # alive, but answers nothing
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        for _ in range(100):
            eng.step()
    elapsed = time.monotonic() - t0
    assert elapsed < 2 + 6, f"the error took {elapsed:.1f}s"
    assert "no answer within 2s while waiting for result from rank 1" in str(err.value)
    assert len(err.value.outputs) == 3 and all(o.error for o in err.value.outputs)
    assert not pid_alive(pid)
    assert spawned_children() <= before
    llm.shutdown()


def test_load_failure_on_a_worker_is_reported_with_its_message(tiny_llama, tmp_path):
    from safetensors.torch import save_file

    from pipespec.model.weights import SafetensorsSource

    src = SafetensorsSource.from_folder(Path(tiny_llama))
    kept = {n: src.get(n) for n in src.names() if not n.startswith("model.layers.2.")}
    save_file(kept, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_llama) / f, tmp_path / f)
    before = spawned_children()
    t0 = time.monotonic()
    with pytest.raises(StageError) as err:
        LLM(model=str(tmp_path), pipeline_parallel_size=2, pp_layer_partition="2,1", **TINY_KWARGS)
    msg = str(err.value)
    assert "pipeline stage 1 failed while loading" in msg, msg
    assert "checkpoint is missing tensor(s): model.layers.2." in msg, msg
    assert "stage 0" not in msg                 # stage 0 (layers 0-1) loaded fine
    assert time.monotonic() - t0 < 60
    assert spawned_children() <= before


def test_bad_layer_partition_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="pp_layer_partition 2,2 covers 4 layers, but the model has 3"):
        LLM(model=str(tiny_llama), pipeline_parallel_size=2, pp_layer_partition="2,2", **TINY_KWARGS)
    with pytest.raises(ValueError, match="has 3 stages, but pipeline_parallel_size is 2"):
        LLM(model=str(tiny_llama), pipeline_parallel_size=2, pp_layer_partition=[1, 1, 1], **TINY_KWARGS)


def test_cli_pipeline_flags(monkeypatch):
    from pipespec.cli import build_parser, engine_kwargs
    from pipespec.config import EngineConfig

    args = build_parser().parse_args(["generate", "-pp", "3", "--pp-layer-partition", "12,10,8",
                                      "--stage-timeout", "5", "--threads-per-stage", "1", "hi"])
    par = EngineConfig.from_kwargs(**engine_kwargs(args)).parallel
    assert (par.pipeline_parallel_size, par.pp_layer_partition, par.stage_timeout, par.threads_per_stage) \
        == (3, (12, 10, 8), 5.0, 1)
    assert par.layer_ranges(30) == [(0, 12), (12, 22), (22, 30)]
    # under torchrun the pipeline size defaults to the world size
    for k, v in dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    args = build_parser().parse_args(["generate", "hi"])
    assert engine_kwargs(args)["pipeline_parallel_size"] == 2


_CTRL_C_SCRIPT = textwrap.dedent("""
    import sys
    from pipespec import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(model=sys.argv[1], pipeline_parallel_size=2, **{kwargs})
        print("PIDS", *llm.engine.executor.worker_pids, flush=True)
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        while True:
            llm.generate([{{"prompt_token_ids": [5, 6, 7]}}] * 4, params, use_tqdm=False)
            print("GENERATED", flush=True)
""")


@pytest.mark.serial
def test_ctrl_c_shuts_everything_down(tiny_llama, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(_CTRL_C_SCRIPT.format(kwargs=repr(TINY_KWARGS)))
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_llama)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_in_a_terminal)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read() if proc.poll() is not None else "no pids"
        pids = [int(x) for x in line.split()[1:]]
        assert proc.stdout.readline().startswith("GENERATED")          # it is generating
        os.killpg(proc.pid, signal.SIGINT)     # what Ctrl-C in a terminal does: the whole group
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert code != 0 and "KeyboardInterrupt" in proc.stderr.read()
    deadline = time.monotonic() + 10
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(p) for p in pids)


def test_torchrun_launch_matches_pp1(tiny_llama):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed")
    prompts = ["Hello there", "The sky is"]
    with LLM(model=str(tiny_llama), **TINY_KWARGS) as llm:
        expected = [o.outputs[0].text for o in
                    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                                 use_tqdm=False)]
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "pipespec", "--log-level",
           "WARNING", "generate", "--model", str(tiny_llama), "--device", "cpu", "--dtype", "float32",
           "--max-model-len", "256", "--num-kv-blocks", "64", "--max-tokens", "8", "--ignore-eos", *prompts]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    texts = re.findall(r"### prompt: .*?tokens\)\n(.*?)\n### \d+ tokens, finish_reason=", run.stdout, re.S)
    assert texts == expected, run.stdout
