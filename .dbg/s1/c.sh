export PYTHONPATH=/root/site:$PWD PIPESPEC_DEFAULT_MODEL=/root/stash/smollm2.gguf
timeout 280 python benchmarks/step_gaps.py --batch 1 --new-tokens 128 --max-k 2 2>&1 | grep -v Warning | tail -8
timeout 300 python benchmarks/adaptive_k.py --batch 1 64 --new-tokens 128 --max-k 2 --repeats 3 2>&1 | grep -v Warning | tail -20
