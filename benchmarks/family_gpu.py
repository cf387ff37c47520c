"""The MTP families at real shapes with random weights (`--load-format dummy`, bf16) on one GPU:
decode tokens/s at each batch against transformers on the same GPU, the batch-1 fraction of the
weight-bandwidth roofline, MTP K = 1..3 step cost, and PP = 2 over NCCL when two GPUs are there.

Shapes (from the published configs where this machine could read them; see SHAPES):
  qwen3_5_2b        Qwen3.5-2B-class hybrid (Gated DeltaNet + gated attention), dense
  qwen3_5_35b_a3b   Qwen3.5-35B-A3B: 40 layers, 256 experts top-8, hidden 2048
  glm_flash         GLM-4.7-Flash / DeepSeek-V2-Lite-class MLA + MoE (~30B total, ~3B active)
  deepseek_v3_slice DeepSeek-V3's real hidden size, heads and experts, 3 layers (per-layer figures)

Usage (GPU machine): python benchmarks/family_gpu.py --model qwen3_5_2b [--batch 1 64] [--k 0 2]
       [--new-tokens 64] [--repeats 3] [--skip-hf] [--pp 2] [--profile] [--profile-prefill] [--quantization fp8] [--json out.json]
The roofline counts the bytes one batch-1 step must read: every weight but the routed experts, and
top_k / num_experts of those (the experts one token uses). Transformers runs after pipespec is shut
down when both would not fit (its tokens/s is then from a separate phase of the same run).
Each row gives tokens/s of the whole generate call (the prefill included) and of its decode steps
alone (`decode_speed`); the roofline is a decode figure.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_bench import PipespecRunner, TransformersRunner, copy_bandwidth  # noqa: E402
from kernel_profile import decode_profile  # noqa: E402
from spec_decode import print_profile  # noqa: E402

from pipespec import SamplingParams  # noqa: E402

_HYBRID = dict(full_attention_interval=4, head_dim=256, linear_conv_kernel_dim=4, linear_key_head_dim=128,
               linear_value_head_dim=128, partial_rotary_factor=0.25, rms_norm_eps=1e-6, vocab_size=248320,
               max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 10000000.0,
                                                               "partial_rotary_factor": 0.25},
               mtp_num_hidden_layers=1)
_MLA = dict(rms_norm_eps=1e-5, max_position_embeddings=32768, rope_interleave=True, n_group=1, topk_group=1,
            norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            num_nextn_predict_layers=1, tie_word_embeddings=False)
SHAPES = {
    "qwen3_5_2b": ("qwen3_5", dict(_HYBRID, hidden_size=2048, num_hidden_layers=24, num_attention_heads=8,
                                   num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16,
                                   intermediate_size=6144, tie_word_embeddings=True)),
    "qwen3_5_35b_a3b": ("qwen3_5_moe", dict(_HYBRID, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                            num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                                            num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                                            shared_expert_intermediate_size=512, tie_word_embeddings=False)),
    # small enough for a CPU (benchmarks/prefix_cache_hybrid.py): 8 layers, every 4th full attention
    "qwen3_5_cpu_small": ("qwen3_5", dict(_HYBRID, hidden_size=512, num_hidden_layers=8, num_attention_heads=4,
                                          num_key_value_heads=2, head_dim=128, linear_num_key_heads=4,
                                          linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                                          intermediate_size=1536, vocab_size=8192, tie_word_embeddings=True)),
    "glm_flash": ("deepseek_v3", dict(_MLA, hidden_size=2048, num_hidden_layers=47, intermediate_size=10240,
                                      first_k_dense_replace=1, n_routed_experts=64, num_experts_per_tok=4,
                                      moe_intermediate_size=1536, n_shared_experts=1, num_attention_heads=20,
                                      num_key_value_heads=20, q_lora_rank=768, kv_lora_rank=512,
                                      qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256,
                                      routed_scaling_factor=1.8, vocab_size=154880)),
    "deepseek_v3_slice": ("deepseek_v3", dict(_MLA, hidden_size=7168, num_hidden_layers=3, intermediate_size=18432,
                                              first_k_dense_replace=1, n_routed_experts=256, num_experts_per_tok=8,
                                              moe_intermediate_size=2048, n_shared_experts=1, num_attention_heads=128,
                                              num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                              qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                              n_group=8, topk_group=4, routed_scaling_factor=2.5, vocab_size=129280)),
}


def write_folder(name: str) -> tuple[str, dict]:
    """A checkpoint folder holding only config.json and a word-level tokenizer (weights: dummy)."""
    from tokenizers import Tokenizer, models
    model_type, text = SHAPES[name]
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    text = dict(text, bos_token_id=1, eos_token_id=2)
    if model_type.startswith("qwen3_5"):     # the released multimodal layout: text config nested
        cfg = {"model_type": model_type, "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": dict(text, model_type=model_type + "_text"),
               "tie_word_embeddings": text["tie_word_embeddings"]}
    else:
        cfg = dict(text, model_type=model_type, architectures=["DeepseekV3ForCausalLM"])
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    vocab = {f"t{i}": i for i in range(text["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
    return str(folder), text


def hf_model(name: str, text: dict):
    import transformers as tr
    model_type = SHAPES[name][0]
    if model_type == "qwen3_5":
        cls, cfg = tr.Qwen3_5ForCausalLM, tr.Qwen3_5TextConfig(**text)
    elif model_type == "qwen3_5_moe":
        cls, cfg = tr.Qwen3_5MoeForCausalLM, tr.Qwen3_5MoeTextConfig(**text)
    else:
        cls, cfg = tr.DeepseekV3ForCausalLM, tr.DeepseekV3Config(**text)
    with torch.device("cuda"):
        return cls(cfg).to(torch.bfloat16).eval()


_ROUTED = ("experts_gate_up", "experts_down", "experts.gate_up_proj", "experts.down_proj")


def active_bytes(model) -> tuple[int, int]:
    """(all weight bytes, bytes one token's step reads: routed experts at top_k / num_experts)."""
    hybrid, moe = model.arch.hybrid, getattr(getattr(model, "cfg", None), "moe", None)
    share = (moe.top_k / moe.num_experts if moe is not None else
             hybrid.num_experts_per_tok / hybrid.num_experts if hybrid is not None and hybrid.num_experts else 1.0)
    total = active = 0
    for name, p in weights_of(model):
        n = p.numel() * p.element_size()
        total += n
        active += int(n * share) if name.endswith(_ROUTED) else n
    return total, active


def weights_of(model):
    """(name, tensor) of every weight: the parameters and the quantized layers' packed buffers
    (`--quantization`: QuantLinear's, and quantized expert stacks' named as the stack they replace)."""
    from pipespec.model.quant.experts import STACKS
    from pipespec.model.quant.linear import QuantLinear
    yield from model.named_parameters()
    for mname, m in model.named_modules():
        if isinstance(m, (QuantLinear, *STACKS)):
            for bname, b in m.named_buffers(recurse=False):
                yield (mname if isinstance(m, STACKS) else f"{mname}.{bname}"), b


def decode_speed(full: list[float], first: list[float], batch: int, new_tokens: int) -> float:
    """Tokens/s of the decode steps alone: the tokens after the first over the time a full run takes
    beyond a one-token run (which holds the prefill, the first token and the call's fixed costs).
    `tokens_per_s` counts the prefill too: at 64 new tokens a slow prefill weighs on it."""
    return batch * (new_tokens - 1) / (statistics.median(full) - statistics.median(first))


def run(args) -> dict:
    folder, text = write_folder(args.model)
    g = torch.Generator().manual_seed(0)
    groups = {b: [torch.randint(3, text["vocab_size"], (args.prompt_len,), generator=g).tolist() for _ in range(b)]
              for b in args.batch}
    report = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0),
              "torch": torch.__version__, "new_tokens": args.new_tokens, "repeats": args.repeats, "rows": []}
    bandwidth = copy_bandwidth()
    common = dict(model=folder, load_format="dummy", gpu_memory_utilization=args.util, max_model_len=2048,
                  max_num_seqs=max(args.batch), quantization=args.quantization,
                  async_scheduling=False if args.no_async_scheduling else None)
    fulls: dict[tuple, list[float]] = {}      # seconds of a generate of new_tokens tokens
    steps: dict[tuple, list[float]] = {}
    firsts: dict[tuple, list[float]] = {}     # seconds of a one-token generate: prefill and the first token
    spec_extra = None
    if args.draft_vocab_size:       # dummy weights draft at random: any ids measure a draft step's cost
        from pipespec.speculative.draft_vocab import write_draft_vocab
        vocab_file = Path(tempfile.mkdtemp()) / "vocab.safetensors"
        write_draft_vocab(vocab_file, torch.arange(args.draft_vocab_size), {})
        spec_extra = {"draft_vocab": str(vocab_file)}
        report["draft_vocab_size"] = args.draft_vocab_size
    for k in args.k:
        t0 = time.perf_counter()
        eng = PipespecRunner(f"pipespec K={k}" if k else "pipespec", k, spec_extra=spec_extra,
                             pipeline_parallel_size=args.pp, **common)
        report.setdefault("startup_s", {})[k] = round(time.perf_counter() - t0, 1)
        stage = getattr(eng.llm.engine.executor, "stage", None)
        if k == 0 and stage is not None and args.pp == 1:   # the roofline of the whole model on one GPU
            total, active = active_bytes(stage.model)
            report.update(weight_GB=round(total / 1e9, 2), active_GB_per_token=round(active / 1e9, 2),
                          copy_bandwidth_TBps=round(bandwidth / 1e12, 2),
                          roofline_tokens_per_s_batch1=round(bandwidth / active, 1),
                          cuda_graphs=stage.graphs is not None)
        stage = None                          # hold nothing of the engine past its close (its KV cache)
        for b, prompts in groups.items():
            eng.run(prompts, args.new_tokens)                       # warm-up on the timed shape
            for _ in range(args.repeats):
                secs, drafts, accepted = eng.run(prompts, args.new_tokens)
                fulls.setdefault(("pipespec", k, b), []).append(secs)
                firsts.setdefault(("pipespec", k, b), []).append(eng.run(prompts, 1)[0])
                # steps of one request: new tokens over tokens per step (1 + accepted drafts per step)
                per_step = 1 + (accepted / drafts * k if drafts else 0)
                steps.setdefault(("pipespec", k, b), []).append(secs / (args.new_tokens / per_step) * 1e3)
        if args.profile_prefill:              # where a one-token request's time goes: host and device
            prompts = groups[min(groups)][:1]
            params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            print_profile(eng.llm, [{"prompt_token_ids": p} for p in prompts], params,
                          f"{args.model} K={k}, {args.prompt_len}-token prompt",
                          {"self_cpu_time_total": 30, "self_cuda_time_total": 20})
        if args.profile:                      # after the timed runs (the profiler slows later ones)
            # batch 1: where a step's GPU time goes, kernel by kernel
            prompts = groups[min(groups)][:1]
            eng.run(prompts, args.new_tokens)
            row = {"part": "decode profile", "k": k, **decode_profile(
                lambda: eng.run(prompts, args.new_tokens), lambda: eng.run(prompts, 1), args.new_tokens)}
            report.setdefault("profile", []).append(row)
            print(json.dumps(row), flush=True)
        eng.close()
    if not args.skip_hf:
        hf = TransformersRunner("transformers eager", hf_model(args.model, text), 0)
        for b, prompts in groups.items():
            hf.run(prompts, args.new_tokens)
            for _ in range(args.repeats):
                fulls.setdefault(("transformers eager", 0, b), []).append(hf.run(prompts, args.new_tokens)[0])
                firsts.setdefault(("transformers eager", 0, b), []).append(hf.run(prompts, 1)[0])
        hf.close()

    def speeds(key):          # (whole-call tokens/s, decode tokens/s), medians
        b = key[2]
        return (statistics.median(b * args.new_tokens / s for s in fulls[key]),
                decode_speed(fulls[key], firsts[key], b, args.new_tokens))

    for (engine, k, b) in fulls:
        tps, decode = speeds((engine, k, b))
        row = {"engine": engine, "pp": args.pp if engine == "pipespec" else 1, "k": k, "batch": b,
               "tokens_per_s": round(tps, 1), "decode_tokens_per_s": round(decode, 1),
               "first_token_ms": round(statistics.median(firsts[engine, k, b]) * 1e3, 2)}
        peer = ("transformers eager", 0, b)
        if peer in fulls and engine == "pipespec":
            peer_tps, peer_decode = speeds(peer)
            row["vs_transformers"] = round(tps / peer_tps, 2)
            row["decode_vs_transformers"] = round(decode / peer_decode, 2)
        if (engine, k, b) in steps:
            row["step_ms"] = round(statistics.median(steps[engine, k, b]), 3)
        if b == 1 and engine == "pipespec" and "roofline_tokens_per_s_batch1" in report:
            row["roofline_fraction"] = round(tps / report["roofline_tokens_per_s_batch1"], 3)
            row["decode_roofline_fraction"] = round(decode / report["roofline_tokens_per_s_batch1"], 3)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=sorted(SHAPES))
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--util", type=float, default=0.85)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--quantization", choices=["fp8", "awq", "gptq"], default=None,
                    help="random weights in that format (projections; FP8 also the routed experts)")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="schedule synchronously (the peer of the default, async scheduling at K = 0)")
    ap.add_argument("--profile", action="store_true", help="also profile batch-1 decode steps kernel by kernel (the prefill left out)")
    ap.add_argument("--profile-prefill", action="store_true",
                    help="also profile a one-token request (the prefill step) on the host and the device")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="speculative steps draft over a draft vocabulary of this many tokens (the step's cost)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    report = run(args)
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
