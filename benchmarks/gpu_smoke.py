"""First GPU look: pipespec (reference attention, no CUDA graphs) decode speed on one GPU.

Usage: python benchmarks/gpu_smoke.py   (PIPESPEC_DEFAULT_MODEL may point at the GGUF)
"""
import json
import statistics
import time

import torch

from pipespec import LLM, SamplingParams


def main():
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    with LLM(device="cuda") as llm:
        tok = llm.get_tokenizer()
        prompt = tok.encode("Write a short story about a robot who learns to paint.")
        for batch in (1, 16, 64):
            n = 64
            p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.generate([{"prompt_token_ids": prompt}] * batch, p, use_tqdm=False)
            runs = []
            for _ in range(3):
                torch.cuda.synchronize()
                t = time.perf_counter()
                llm.generate([{"prompt_token_ids": prompt}] * batch, p, use_tqdm=False)
                torch.cuda.synchronize()
                runs.append(batch * n / (time.perf_counter() - t))
            out[f"tokens_per_s_batch{batch}"] = round(statistics.median(runs), 1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
