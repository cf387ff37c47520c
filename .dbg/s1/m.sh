mkdir -p /root/site && python -m pip install -q --no-deps .whl/*.whl --target /root/site 2>&1 | tail -1
export PYTHONPATH=/root/site:$PWD
timeout 260 python benchmarks/spec_machinery.py --batch 1 64 --k 1 2 3 --new-tokens 128 --repeats 3 2>&1 | grep '^|'
timeout 280 python benchmarks/gpu_bench.py --skip-compile --skip-smollm2 --batch 1 --repeats 3 2>&1 | grep -E '^\||roofline'
