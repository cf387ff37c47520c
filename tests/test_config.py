"""`config.py`: every check refuses a bad value at construction with a message naming the field and
what it got; good values are kept (and normalized where the config says so)."""
from __future__ import annotations

import dataclasses

import pytest

from pipespec.config import (CHECK_COLLECTIVES_ENV, CacheConfig, EngineConfig, ParallelConfig, SpeculativeConfig)

# (engine keyword arguments, a pattern of the refusal's message)
REFUSED = [
    (dict(dtype="float64"), r"dtype must be one of \('auto', 'float32', 'bfloat16', 'float16'\), got 'float64'"),
    (dict(attention_backend="flash"), r"attention_backend must be one of .*got 'flash'"),
    (dict(load_format="pt"), r"load_format must be one of \('auto', 'dummy'\), got 'pt'"),
    (dict(enforce_eager="yes"), r"enforce_eager must be a bool, got 'yes'"),
    (dict(quantization="int3"), r"quantization must be one of .*got 'int3'"),
    (dict(max_model_len=1), r"max_model_len must be >= 2, got 1"),
    (dict(seed=1.5), r"seed must be an integer or None, got 1.5"),
    (dict(seed=True), r"seed must be an integer or None, got True"),
    (dict(block_size=24), r"block_size must be a power of two, got 24"),
    (dict(block_size=0), r"block_size must be a power of two, got 0"),
    (dict(num_kv_blocks=0), r"num_kv_blocks must be >= 1, got 0"),
    (dict(kv_cache_memory=0), r"kv_cache_memory must be > 0 bytes, got 0"),
    (dict(enable_prefix_caching="on"), r"enable_prefix_caching must be true or false, got 'on'"),
    (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\], got 0.0"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(async_scheduling="auto"), r"async_scheduling must be true, false or None \(auto\), got 'auto'"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be >= 1, got 0"),
    (dict(max_num_seqs=0), r"max_num_seqs must be >= 1, got 0"),
    (dict(long_prefill_token_threshold=-1), r"long_prefill_token_threshold must be an integer >= 0, got -1"),
    (dict(long_prefill_token_threshold=True), r"long_prefill_token_threshold must be an integer >= 0, got True"),
    (dict(pipeline_parallel_size=0), r"pipeline_parallel_size must be an integer >= 1, got 0"),
    (dict(pipeline_parallel_size=2.0), r"pipeline_parallel_size must be an integer >= 1, got 2.0"),
    (dict(tensor_parallel_size=True), r"tensor_parallel_size must be an integer >= 1, got True"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="10;10"),
     r"pp_layer_partition must be comma-separated layer counts like '10,10,10', got '10;10'"),
    (dict(pipeline_parallel_size=2, pp_layer_partition=(3, 0)),
     r"pp_layer_partition must be layer counts >= 1, got \(3, 0\)"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="4,4,4"),
     r"pp_layer_partition 4,4,4 has 3 stages, but pipeline_parallel_size is 2"),
    (dict(stage_timeout=0), r"stage_timeout must be > 0 seconds, got 0"),
    (dict(startup_timeout=-1), r"startup_timeout must be > 0 seconds, got -1"),
    (dict(distributed_backend="mpi"), r"distributed_backend must be one of \('auto', 'gloo', 'nccl'\), got 'mpi'"),
    (dict(threads_per_stage=0), r"threads_per_stage must be an integer >= 1, got 0"),
    # across sections
    (dict(async_scheduling=True, pipeline_parallel_size=2),
     r"async_scheduling needs one stage \(pipeline_parallel_size = tensor_parallel_size = 1\)"),
    (dict(tensor_parallel_size=2, speculative_config={"num_speculative_tokens": 1, "draft_vocab_size": 100}),
     r"draft_vocab / draft_vocab_size need tensor_parallel_size 1"),
]

SPEC_REFUSED = [
    ({"method": "eagle"}, r"speculative_config.method must be 'mtp', got 'eagle'"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens must be an integer in 1..8, got 0"),
    ({"num_speculative_tokens": 9}, r"num_speculative_tokens must be an integer in 1..8, got 9"),
    ({"num_speculative_tokens": True}, r"num_speculative_tokens must be an integer in 1..8, got True"),
    ({"num_speculative_tokens": 0, "adaptive": True}, r"speculative_config.adaptive needs speculation"),
    ({"adaptive": "yes"}, r"speculative_config.adaptive must be true or false, got 'yes'"),
    ({"draft_vocab": ""}, r"speculative_config.draft_vocab must be a file's path, got ''"),
    ({"draft_vocab_size": 0}, r"speculative_config.draft_vocab_size must be a positive integer"),
    ({"k_sequence": [1, 0]}, r"k_sequence forces the steps' K of adaptive K; set \"adaptive\": true with it"),
    ({"num_speculative_tokens": 2, "adaptive": True, "k_sequence": [1, 3]},
     r"k_sequence must be a non-empty list of integers in 0..2, got \[1, 3\]"),
    ({"num_speculative_tokens": 2, "adaptive": True, "k_sequence": []}, r"k_sequence must be a non-empty list"),
    ({"num_speculative_tokens": 2, "rounds": 3}, r"speculative_config has unknown keys \['rounds'\]; known: method, "),
    ('{"num_speculative_tokens": 2,', r"speculative_config is not valid JSON"),
    ("[2]", r"speculative_config must be a dict or JSON object, got list"),
]


@pytest.mark.parametrize("kwargs,message", REFUSED, ids=[",".join(k) for k, _ in REFUSED])
def test_a_bad_value_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


@pytest.mark.parametrize("spec,message", SPEC_REFUSED, ids=[str(i) for i in range(len(SPEC_REFUSED))])
def test_a_bad_speculative_config_is_refused_naming_it(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(speculative_config=spec)


def test_an_unknown_argument_is_a_type_error():
    with pytest.raises(TypeError, match="unknown engine argument 'max_batch_size'"):
        EngineConfig.from_kwargs(max_batch_size=8)


def test_good_values_land_in_their_section_and_are_normalized():
    cfg = EngineConfig.from_kwargs(dtype="bfloat16", block_size=32, max_num_seqs=4, pipeline_parallel_size=3,
                                   pp_layer_partition=" 2, 3,4", speculative_config='{"num_speculative_tokens": 3, '
                                   '"adaptive": true, "k_sequence": [3, 0, 1]}')
    assert (cfg.model.dtype, cfg.cache.block_size, cfg.scheduler.max_num_seqs) == ("bfloat16", 32, 4)
    assert cfg.parallel.pp_layer_partition == (2, 3, 4)          # the string form, parsed
    assert cfg.speculative.k_sequence == (3, 0, 1) and cfg.num_spec_tokens == 3
    assert EngineConfig().num_spec_tokens == 0 and SpeculativeConfig.parse(None) is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.cache.block_size = 8                                  # frozen: checked once, trusted after


def test_layer_ranges_split_evenly_or_as_given_and_check_the_model():
    assert ParallelConfig(pipeline_parallel_size=3).layer_ranges(8) == [(0, 3), (3, 6), (6, 8)]
    assert ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(1, 4)).layer_ranges(5) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="pipeline_parallel_size=4 exceeds the model's 3 layers"):
        ParallelConfig(pipeline_parallel_size=4).layer_ranges(3)
    with pytest.raises(ValueError, match="pp_layer_partition 1,4 covers 5 layers, but the model has 6"):
        ParallelConfig(pipeline_parallel_size=2, pp_layer_partition=(1, 4)).layer_ranges(6)


def test_prefill_chunk_limit_and_step_overlap_defaults():
    assert EngineConfig.from_kwargs(max_num_batched_tokens=64).scheduler.prefill_chunk_limit == 16
    assert EngineConfig.from_kwargs(long_prefill_token_threshold=0).scheduler.prefill_chunk_limit == 0     # no limit
    one, two = EngineConfig(), EngineConfig.from_kwargs(pipeline_parallel_size=2)
    assert one.async_scheduling_on("cuda") and not one.async_scheduling_on("cpu")
    assert not two.async_scheduling_on("cuda")
    assert EngineConfig.from_kwargs(async_scheduling=True).async_scheduling_on("cpu")


def test_check_collectives_defaults_from_the_environment(monkeypatch):
    monkeypatch.setenv(CHECK_COLLECTIVES_ENV, "1")
    assert ParallelConfig().check_collectives
    monkeypatch.setenv(CHECK_COLLECTIVES_ENV, "off")
    assert not ParallelConfig().check_collectives
    assert CacheConfig().enable_prefix_caching
