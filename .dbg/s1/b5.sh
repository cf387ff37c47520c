cp .stash_b/gguf_part_ab /root/stash/ && cat /root/stash/gguf_part_aa /root/stash/gguf_part_ab > /root/stash/smollm2.gguf
export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 110 python -m pytest -q -n 4 tests/stage/test_cuda_graphs.py tests/model/test_families_cuda.py 2>&1 | grep -E "^E |^FAILED|passed|failed" | head -12
timeout 80 python benchmarks/spec_machinery.py --batch 1 64 --k 1 3 --new-tokens 128 --repeats 3 2>&1 | grep -E '^\||Error'
timeout 90 python benchmarks/adaptive_k.py --batch 1 8 64 --new-tokens 128 --max-k 2 --repeats 3 2>&1 | grep -E '^\||Error'
