"""Engine flags of the CLI and the server, named as vLLM names them, and the keyword arguments of
`LLM(...)` / `EngineConfig.from_kwargs` they become."""
from __future__ import annotations

import argparse


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command, named as vLLM names them."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face folder or GGUF file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations; auto: float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--max-model-len", type=parse_max_model_len, default=None,
                   help="longest prompt plus output, in tokens; vLLM's spellings work: 4096, 1k (1000), 1K (1024), "
                        "25.6k, -1 or auto (default: the model's context length, lowered to what the KV cache holds)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder, GGUF file or Hugging Face Hub id (default: the model's)")
    g.add_argument("--revision", default=None,
                   help="branch, tag or commit of a Hub model id (default: main)")
    g.add_argument("--tokenizer-revision", default=None, help="branch, tag or commit of a Hub --tokenizer id")
    g.add_argument("--download-dir", default=None,
                   help="cache folder of Hub downloads (default: huggingface_hub's, $HF_HUB_CACHE)")
    g.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=False,
                   help="accepted for vLLM compatibility and ignored: pipespec never runs code from a "
                        "checkpoint; it supports the architectures it implements itself")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template replacing the model's: a file, or the template itself")
    g.add_argument("--tokenizer-mode", default="auto", type=_tokenizer_mode,
                   help="auto only: the model folder's `tokenizers` fast tokenizer")
    g.add_argument("--kv-cache-dtype", default="auto", type=_kv_cache_dtype,
                   help="auto only: the KV cache is stored in the model's dtype (FP8 KV caches are not "
                        "implemented)")
    g.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="auto: Triton paged-attention kernels on CUDA, PyTorch reference elsewhere")
    g.add_argument("--enforce-eager", action="store_true", help="do not capture or replay CUDA graphs")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the model's shapes, nothing read (for benchmarks)")
    g.add_argument("--quantization", "-q", default=None, choices=["fp8", "awq", "gptq"],
                   help="with --load-format dummy: random weights in this format (block-scaled FP8, int4); "
                        "with a checkpoint: must match its quantization_config")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks (default: from --kv-cache-memory on CPU, free memory on GPU)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes for the KV cache on CPU (default: 1 GiB)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights, activations and KV cache")
    g.add_argument("--max-num-seqs", type=int, default=64, help="requests running at once")
    g.add_argument("--max-num-batched-tokens", type=int, default=1024, help="token budget of one step")
    g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request's prefill chunk takes in a step while other "
                        "requests are running or waiting, so a long prompt does not hold them back; "
                        "0: no limit (default: a quarter of --max-num-batched-tokens)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="split long prompts over several steps (default: on; --no-enable-chunked-prefill: "
                        "prefill each prompt in one step, which must fit --max-num-batched-tokens)")
    g.add_argument("--no-chunked-prefill", action="store_true", help="the same as --no-enable-chunked-prefill")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of prompt prefixes already computed (full blocks); "
                        "--no-enable-prefix-caching turns it off")
    g.add_argument("--prefix-cache-state-snapshots", type=int, default=None, metavar="N",
                   help="models with linear-attention layers (Qwen3.5/3.6, Qwen3-Next): snapshots of those "
                        "layers' states the prefix cache keeps (a hit needs one where it ends), each the size of "
                        "a request's state (61 MiB on Qwen3.5-35B-A3B); default: as many as a tenth of the cache "
                        "memory holds, at most one per KV block (--num-kv-blocks given: --max-num-seqs); 0: no "
                        "prefix caching for such models")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan step n + 1 while the device runs step n, speculative steps included (default: "
                        "on with one stage on a GPU; --no-async-scheduling turns it off)")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='MTP speculative decoding, e.g. \'{"method": "mtp", "num_speculative_tokens": 3}\' '
                        '(add "model": PATH for a head file; "adaptive": true to let the engine pick each '
                        "step's K in 0..num_speculative_tokens from measured acceptance and step costs)")
    pp = p.add_argument_group("pipeline and tensor parallelism")
    pp.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None,
                    help="pipeline stages (default: 1, or WORLD_SIZE / tensor-parallel size under torchrun)")
    pp.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                    help="ranks (GPUs) per stage, splitting its heads, intermediate size and vocabulary; "
                         "T x P processes in all (default: 1)")
    pp.add_argument("--pp-layer-partition", default=None, metavar="N,N,...",
                    help="layers of each stage, e.g. 10,10,10 (default: as even as possible)")
    pp.add_argument("--custom-all-reduce", action="store_true",
                    help="TP on GPUs: decode-sized sums through a one-host symmetric-memory all-reduce "
                         "instead of NCCL (experimental; default off)")
    pp.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="accepted for vLLM compatibility: pipespec's custom all-reduce is off unless "
                         "--custom-all-reduce")
    pp.add_argument("--stage-timeout", type=float, default=30.0,
                    help="seconds a stage may stay silent before the engine fails")
    pp.add_argument("--distributed-backend", default="auto", choices=["auto", "gloo", "nccl"],
                    help="activations between stages: auto = nccl on CUDA, gloo on CPU")
    pp.add_argument("--threads-per-stage", type=int, default=None,
                    help="CPU threads of each stage (default: the cores this process may use, from its "
                         "CPU affinity and cgroup quota, divided among the stages that share them)")


def engine_kwargs(args: argparse.Namespace) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
                load_format=args.load_format, quantization=args.quantization,
                block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                enable_prefix_caching=args.enable_prefix_caching,
                prefix_cache_state_snapshots=args.prefix_cache_state_snapshots,
                kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_chunked_prefill=not args.no_chunked_prefill and args.enable_chunked_prefill is not False,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                async_scheduling=args.async_scheduling,
                pipeline_parallel_size=_pipeline_size(args.pipeline_parallel_size, args.tensor_parallel_size),
                tensor_parallel_size=args.tensor_parallel_size,
                pp_layer_partition=args.pp_layer_partition, stage_timeout=args.stage_timeout,
                custom_all_reduce=args.custom_all_reduce,
                distributed_backend=args.distributed_backend, threads_per_stage=args.threads_per_stage,
                speculative_config=args.speculative_config, revision=args.revision,
                download_dir=args.download_dir, tokenizer=args.tokenizer,
                tokenizer_revision=args.tokenizer_revision, chat_template=args.chat_template)


def parse_max_model_len(text: str) -> int | None:
    """vLLM's --max-model-len: an integer, with k/m (x1000) or K/M (x1024) suffix, decimals allowed
    with a suffix (25.6k); -1 or auto: the model's own length (what fits the KV cache)."""
    value = text.strip()
    if value.lower() in ("-1", "auto"):
        return None
    scale = {"k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
    try:
        if value and value[-1] in scale:
            number = float(value[:-1]) * scale[value[-1]]
            if number != int(number):
                raise ValueError
            return int(number)
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length in tokens (e.g. 4096, 4k, 4K, auto)") from None


def _tokenizer_mode(text: str) -> str:
    if text not in ("auto", "hf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: pipespec always uses the model folder's "
                                         "`tokenizers` fast tokenizer (auto)")
    return "auto"


def _kv_cache_dtype(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r} is not supported: pipespec keeps the KV cache in the model's "
                                         "dtype (auto); FP8 KV caches are not implemented")
    return text


def _pipeline_size(asked: int | None, tp: int) -> int:
    if asked is not None:
        return asked
    from pipespec.runtime.launch import torchrun_env
    env = torchrun_env()
    if env is None:
        return 1
    if tp < 1 or env.world_size % tp:
        raise ValueError(f"torchrun started {env.world_size} processes, which --tensor-parallel-size {tp} "
                         "does not divide")
    return env.world_size // tp
