set -x
mkdir -p /root/stash /root/site
python -m pip install -q --no-deps .whl/*.whl --target /root/site 2>&1 | tail -1
cp .stash_a/gguf_part_aa /root/stash/
export PYTHONPATH=/root/site:$PWD
nvidia-smi --query-gpu=name,memory.used --format=csv
timeout 500 python -m pytest -q -x -n 6 tests/kernels tests/model/quant 2>&1 | tail -25
