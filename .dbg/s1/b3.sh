cp .stash_b/gguf_part_ab /root/stash/ && cat /root/stash/gguf_part_aa /root/stash/gguf_part_ab > /root/stash/smollm2.gguf
export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 240 python -m pytest -q -n 6 tests/stage/test_cuda_graphs.py tests/model/test_families_cuda.py 2>&1 | tail -6
timeout 120 python benchmarks/step_gaps.py --batch 1 --new-tokens 128 --max-k 2 2>&1 | grep '^{' | cut -c1-900
timeout 120 python benchmarks/step_gaps.py --batch 64 --new-tokens 128 --max-k 2 2>&1 | grep '^{' | cut -c1-900
timeout 200 python benchmarks/adaptive_k.py --batch 1 8 64 --new-tokens 128 --max-k 2 --repeats 3 2>&1 | grep '^|'
