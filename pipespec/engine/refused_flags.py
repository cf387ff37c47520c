"""`vllm serve` flags that pipespec does not take, each with the reason a user gets.

Flags pipespec implements (or accepts because they change nothing here) are ordinary argparse flags;
a flag in this table that some command does define is not refused (see `refused_flag`), so adding
the feature later only means adding its flag.
"""
from __future__ import annotations

REFUSED_FLAGS: dict[str, str] = {
    "--enable-lora": "LoRA adapters are not implemented; merge the adapter into the weights and serve the result",
    "--lora-modules": "LoRA adapters are not implemented; merge the adapter into the weights and serve the result",
    "--max-loras": "LoRA adapters are not implemented",
    "--max-lora-rank": "LoRA adapters are not implemented",
    "--data-parallel-size": "no data parallelism inside one server: run one `pipespec serve` per replica "
                            "behind a load balancer",
    "-dp": "no data parallelism inside one server: run one `pipespec serve` per replica behind a load balancer",
    "--enable-expert-parallel": "experts are split across the tensor-parallel ranks (-tp); there is no "
                                "separate expert parallelism",
    "--distributed-executor-backend": "pipespec starts its stage processes itself on one machine, or runs "
                                      "under torchrun across machines; there is no Ray or executor choice",
    "--cpu-offload-gb": "weight offloading is not implemented",
    "--swap-space": "preempted requests are recomputed, never swapped to CPU memory",
    "--kv-transfer-config": "disaggregated prefill/decode is not implemented",
    "--speculative-model": "use --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": K}' "
                           "(pipespec drafts with MTP heads only)",
    "--num-speculative-tokens": "use --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": K}'",
    "--guided-decoding-backend": "structured output always uses llguidance (pip install 'pipespec[structured]'); "
                                 "there is no backend to choose",
    "--structured-outputs-config": "structured output always uses llguidance (pip install 'pipespec[structured]'); "
                                   "there is nothing to configure",
    "--ssl-keyfile": "no TLS in the server: put a TLS-terminating proxy in front of it",
    "--ssl-certfile": "no TLS in the server: put a TLS-terminating proxy in front of it",
    "--ssl-ca-certs": "no TLS in the server: put a TLS-terminating proxy in front of it",
    "--root-path": "serve at / and let the proxy in front rewrite the path",
    "--allowed-origins": "no CORS handling in the server: let the proxy in front add the headers",
    "--middleware": "no custom ASGI middleware",
    "--response-role": "the assistant role is always 'assistant'",
    "--task": "pipespec only generates text (no embedding, classification or scoring)",
    "--runner": "pipespec only generates text (no pooling runner)",
    "--code-revision": "pipespec never runs code from a checkpoint, so there is no code revision to pick",
    "--hf-token": "set HF_TOKEN in the environment: huggingface_hub reads it",
    "--hf-overrides": "config overrides are not implemented; edit a copy of config.json instead",
    "--rope-scaling": "rope scaling comes from the checkpoint's config.json; edit a copy of it instead",
    "--limit-mm-per-prompt": "pipespec serves text only (a multimodal model's vision tower is not loaded)",
    "--mm-processor-kwargs": "pipespec serves text only (a multimodal model's vision tower is not loaded)",
    "--max-logprobs": "requests may ask for up to 20 logprobs per token (vLLM's default); the cap is fixed",
    "--scheduling-policy": "requests are scheduled first come, first served; priorities are not implemented",
    "--enable-sleep-mode": "sleep mode is not implemented",
    "--compilation-config": "pipespec does not use torch.compile; CUDA graphs are on by default "
                            "(--enforce-eager turns them off)",
    "--max-seq-len-to-capture": "CUDA graphs cover decode steps of any length; --enforce-eager turns them off",
    "--quantization-param-path": "FP8 KV caches (and their scales) are not implemented",
    "--max-parallel-loading-workers": "each stage loads its own weights in one pass; there is nothing to bound",
    "--disable-sliding-window": "sliding-window attention follows the checkpoint's config",
    "--cuda-graph-sizes": "CUDA graphs are captured for the decode batch sizes the engine needs; "
                          "--enforce-eager turns them off",
    "--model-impl": "pipespec runs its own implementation of each architecture (no transformers backend)",
    "--generation-config": "sampling defaults come from the request, not from generation_config.json",
    "--api-server-count": "one API server process per engine",
    "--headless": "no headless engine mode: every `pipespec serve` runs its own API server",
    "--config": "no YAML config file: pass the flags on the command line",
}


def refused_flag(argv: list[str], known: set[str]) -> tuple[str, str] | None:
    """The first flag of `argv` (up to a `--`) that the table refuses and no parser defines, with why."""
    for arg in argv:
        if arg == "--":
            return None
        name = arg.split("=", 1)[0]
        if name in REFUSED_FLAGS and name not in known:
            return name, REFUSED_FLAGS[name]
    return None
