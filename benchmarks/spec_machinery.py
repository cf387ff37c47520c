"""What speculation's machinery keeps of a perfect head: a SmolLM2-shaped Llama whose MTP layer
drafts right every time, so a step at K yields K + 1 tokens and the speedup over K = 0 divided by
K + 1 is the share the machinery (verify rows, draft steps, host work) leaves (issue 17: >= 0.8 at
K = 3, batch 1). Reported for whole runs and for decode alone: the time of a one-token run (the
prefill and first result, the same work at every K) taken off.

The checkpoint is built, not trained: unit-norm random embeddings, lm_head[j] = embedding[j - 1],
every layer's output projections (o_proj, down_proj) zero, norms one. The target's final hidden is
then its input token's embedding, so it says t + 1 after t. The MTP layer (DeepSeek-V3's names, on
a Llama target) takes the embedding half of its concat ([I | 0] projection): it drafts t + 2 from
t + 1, and its chained steps likewise. Shapes and kernels are SmolLM2-135M's (30 layers, 576 wide,
9 heads, 3 KV heads, 49,152 tokens); the weights that do not matter are random.

Usage (GPU machine): python benchmarks/spec_machinery.py [--batch 1 64] [--k 1 2 3] [--new-tokens 128]
CPU check of the construction: python benchmarks/spec_machinery.py --device cpu --layers 2 --batch 1 --k 2 --new-tokens 16
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
from safetensors.torch import save_file

from pipespec import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from spec_decode import print_profile, print_table  # noqa: E402

H, I, HEADS, KV_HEADS, VOCAB = 576, 1536, 9, 3, 49152


def write_checkpoint(folder: Path, layers: int, dtype: torch.dtype) -> Path:
    from tokenizers import Tokenizer, models
    g = torch.Generator().manual_seed(0)
    d = H // HEADS
    emb = torch.nn.functional.normalize(torch.randn(VOCAB, H, generator=g), dim=-1)
    t = {"model.embed_tokens.weight": emb, "lm_head.weight": emb.roll(1, dims=0), "model.norm.weight": torch.ones(H)}

    def block(prefix: str) -> None:
        small = lambda *shape: 0.02 * torch.randn(*shape, generator=g)       # noqa: E731
        t.update({prefix + "input_layernorm.weight": torch.ones(H), prefix + "post_attention_layernorm.weight": torch.ones(H),
                  prefix + "self_attn.q_proj.weight": small(HEADS * d, H), prefix + "self_attn.k_proj.weight": small(KV_HEADS * d, H),
                  prefix + "self_attn.v_proj.weight": small(KV_HEADS * d, H), prefix + "self_attn.o_proj.weight": torch.zeros(H, HEADS * d),
                  prefix + "mlp.gate_proj.weight": small(I, H), prefix + "mlp.up_proj.weight": small(I, H),
                  prefix + "mlp.down_proj.weight": torch.zeros(H, I)})

    for layer in range(layers):
        block(f"model.layers.{layer}.")
    mtp = f"model.layers.{layers}."
    block(mtp)
    t.update({mtp + "enorm.weight": torch.ones(H), mtp + "hnorm.weight": torch.ones(H),
              mtp + "shared_head.norm.weight": torch.ones(H),
              mtp + "eh_proj.weight": torch.cat([torch.eye(H), torch.zeros(H, H)], dim=1)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in t.items()}, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch."),
              "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))
    return folder


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help="then profile a generate of K = 0 and the largest K at the first batch size")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="as the engine's flag (default: on on a GPU)")
    args = ap.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    folder = write_checkpoint(Path(tempfile.mkdtemp(prefix="spec-machinery-")), args.layers, dtype)
    share = dict(gpu_memory_utilization=0.1) if args.device == "cuda" else {}
    engines = {k: LLM(model=str(folder), device=args.device, max_num_seqs=max(args.batch), max_model_len=1024,
                      speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
                      async_scheduling=args.async_scheduling, **share)
               for k in [0] + args.k}
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rows = []
    for batch in args.batch:
        prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (24,), generator=g).tolist()} for _ in range(batch)]
        whole, first = {k: [] for k in engines}, {k: [] for k in engines}
        for _ in range(args.repeats + 1):             # the first round warms up; engines interleaved
            for k, llm in engines.items():
                # a one-token run (its prefill and first result, the same at every K), and the whole run
                for times, p in ((first, one_token), (whole, params)):
                    start = time.perf_counter()
                    outs = llm.generate(prompts, p, use_tqdm=False)
                    times[k].append(time.perf_counter() - start)
                ids = outs[0].prompt_token_ids + outs[0].outputs[0].token_ids
                assert all(b == a + 1 for a, b in zip(ids[23:], ids[24:])), "the constructed target says t + 1"
        tps = {k: batch * args.new_tokens / statistics.median(whole[k][1:]) for k in engines}
        # decode alone: the tokens after the first over the time after the first result
        steady = {k: batch * (args.new_tokens - 1) / (statistics.median(whole[k][1:]) - statistics.median(first[k][1:]))
                  for k in engines}
        for k, llm in engines.items():
            stats = llm.engine.stats().get("spec_decode", {})
            accept = stats.get("mean_acceptance_length") if k else 1.0
            rows.append({"batch": batch, "K": k, "tokens_per_s": round(tps[k], 1), "vs_k0": round(tps[k] / tps[0], 3),
                         "acceptance_length": round(accept, 3),
                         "speedup_per_acceptance_length": round(tps[k] / tps[0] / accept, 3),
                         "first_result_ms": round(1e3 * statistics.median(first[k][1:]), 2),
                         "decode_speedup_per_acceptance_length": round(steady[k] / steady[0] / accept, 3)})
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, {"batch": lambda r: r["batch"], "K": lambda r: r["K"], "tokens/s": lambda r: r["tokens_per_s"],
                       "vs K=0": lambda r: f"{r['vs_k0']}x", "acceptance length": lambda r: r["acceptance_length"],
                       "speedup / acceptance length": lambda r: r["speedup_per_acceptance_length"],
                       "first result (ms)": lambda r: r["first_result_ms"],
                       "decode alone: speedup / acceptance length": lambda r: r["decode_speedup_per_acceptance_length"]})
    if args.profile:
        prompts = [{"prompt_token_ids": torch.randint(3, VOCAB, (24,), generator=g).tolist()} for _ in range(args.batch[0])]
        for k in (0, max(args.k)):
            print_profile(engines[k], prompts, params, f"K={k}, batch {args.batch[0]}",
                          {"cuda_time_total": 20, "self_cpu_time_total": 25})
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
