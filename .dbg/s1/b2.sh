cp .stash_b/gguf_part_ab /root/stash/ && cat /root/stash/gguf_part_aa /root/stash/gguf_part_ab > /root/stash/smollm2.gguf
export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 200 python benchmarks/step_gaps.py --batch 1 --new-tokens 128 --max-k 2 --profile-first 2>&1 | grep -v Warning | tail -150
timeout 150 python benchmarks/step_gaps.py --batch 64 --new-tokens 128 --max-k 2 2>&1 | grep -v Warning | tail -4
timeout 200 python benchmarks/adaptive_k.py --batch 1 8 64 --new-tokens 128 --max-k 2 --repeats 3 2>&1 | grep -v Warning | tail -14
