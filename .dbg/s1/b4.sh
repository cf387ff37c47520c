cp .stash_b/gguf_part_ab /root/stash/ && cat /root/stash/gguf_part_aa /root/stash/gguf_part_ab > /root/stash/smollm2.gguf
export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 200 python -m pytest -q -n 4 tests/kernels/test_carry_in.py tests/stage/test_cuda_graphs.py tests/model/test_families_cuda.py 2>&1 | grep -E "^E |^FAILED|passed|failed" | head
timeout 100 python benchmarks/step_gaps.py --batch 1 --new-tokens 128 --max-k 2 2>&1 | grep '^{' | cut -c1-700
timeout 200 python benchmarks/adaptive_k.py --batch 1 8 64 --new-tokens 128 --max-k 2 --repeats 3 2>&1 | grep '^|'
timeout 240 python benchmarks/gpu_bench.py --skip-compile --skip-8b --batch 1 64 --repeats 3 2>&1 | grep '^|'
