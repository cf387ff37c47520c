set -x
cp .stash_b/gguf_part_ab /root/stash/ && cat /root/stash/gguf_part_aa /root/stash/gguf_part_ab > /root/stash/smollm2.gguf && ls -la /root/stash
export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 330 python -m pytest -q -n 6 tests/model/quant tests/stage/test_cuda_graphs.py tests/model/test_families_cuda.py 2>&1 | tail -25
timeout 240 python benchmarks/step_gaps.py --batch 64 --new-tokens 128 --max-k 2 2>&1 | grep -v Warning | tail -8
