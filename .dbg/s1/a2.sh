mkdir -p /root/stash /root/site
python -m pip install -q --no-deps .whl/*.whl --target /root/site 2>&1 | tail -1
cp .stash_a/gguf_part_aa /root/stash/ && echo copied
