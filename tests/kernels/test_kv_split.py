"""The split-KV rule of the attention kernels (`kernels/kv_split.py`): host arithmetic, on CPU."""

from pipespec.kernels import SMLimits
from pipespec.kernels.kv_split import num_kv_splits, resident_programs, wave_splits

H200 = SMLimits()


def test_resident_programs_take_the_tightest_limit():
    # the H200's compiled decode variants (attention_kernel.py --splits): registers bind both
    assert resident_programs(148, 39936, 4, H200) == 3          # 64-dim heads (smem alone: 5)
    assert resident_programs(228, 74752, 4, H200) == 2          # 128-dim heads (smem alone: 3)
    assert resident_programs(32, 100 << 10, 4, H200) == 2       # shared memory, 1 KiB a block more
    assert resident_programs(16, 0, 1, H200) == 32              # the SM's 32 blocks
    assert resident_programs(16, 0, 8, H200) == 8               # its 2,048 threads
    assert resident_programs(255, 0, 8, H200) == 1


def test_split_count_fills_whole_waves():
    """The H200's measured fastest split counts (RESULTS.md, seventeenth session): 396 slots for
    64-dim heads (132 SMs x 3), 264 for 128-dim ones."""
    assert wave_splits(programs=8, max_kv=512, slots=396, block_n=128) == 1        # short contexts: one program
    assert wave_splits(programs=192, max_kv=4096, slots=396, block_n=128) == 2     # 64 requests x 3 KV heads
    assert wave_splits(programs=96, max_kv=8192, slots=396, block_n=128) == 4
    assert wave_splits(programs=48, max_kv=16384, slots=396, block_n=128) == 8
    assert wave_splits(programs=24, max_kv=8192, slots=396, block_n=128) == 16
    assert wave_splits(programs=3, max_kv=4096, slots=396, block_n=128) == 16      # >= 256 keys a split
    assert wave_splits(programs=3, max_kv=32768, slots=396, block_n=128) == 128
    assert wave_splits(programs=512, max_kv=4096, slots=264, block_n=128) == 1     # two full waves already
    assert wave_splits(programs=128, max_kv=16384, slots=264, block_n=128) == 2
    assert wave_splits(programs=64, max_kv=8192, slots=264, block_n=128) == 4
    assert wave_splits(programs=8, max_kv=32768, slots=264, block_n=128) == 32
    # a last wave of a few programs costs a whole one: 3 splits of 192 programs on 264 slots leave
    # 48 in a third wave, 4 give three full ones of shorter programs
    assert wave_splits(programs=192, max_kv=4096, slots=264, block_n=128) == 4
    assert wave_splits(programs=1, max_kv=1 << 20, slots=396, block_n=128, max_splits=128) == 128


def test_mla_rule_targets_four_programs_an_sm():
    assert num_kv_splits(programs=528, max_kv=32768, sms=132) == 1        # the grid fills the GPU
    assert num_kv_splits(programs=8, max_kv=32768, sms=132) == 66
    assert num_kv_splits(programs=8, max_kv=512, sms=132) == 1
