"""pipespec against transformers on one GPU, in one run: decode tokens/s by model, batch and K.

Rows: SmolLM2-135M-Instruct bf16 (real weights, bundled MTP head: real acceptance), pipespec with
CUDA graphs (and eager, for the graphs' share) at K = 0..3, against transformers `generate` eager and
with a static cache + torch.compile; a Llama-3-8B-shaped model with random bf16 weights against the
memory-bandwidth roofline (weight bytes per step over the copy bandwidth measured in this run).

Usage (GPU machine): python benchmarks/gpu_bench.py [--new-tokens 128] [--repeats 3] [--skip-compile]
       [--skip-8b] [--json out.json]
Tokens/s counts generated tokens over the wall time of a whole `generate` (prefill included), median
over repeats, engines interleaved per repeat so drift hits all alike.
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
from gpu_timing import time_replay  # noqa: E402
from spec_decode import chat_ids, print_table  # noqa: E402  (the same held-out-style chat prompts)

from pipespec import LLM, SamplingParams  # noqa: E402

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=8192, tie_word_embeddings=False)


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second (median of 20)."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)       # 2 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * (1 << 30) * 2 / statistics.median(times)


def gemv_bandwidth(model) -> dict[str, float]:
    """Weight TB/s of one batch-1 F.linear (cuBLAS) per distinct weight shape: the roofline's
    building blocks, as the engine runs them."""
    from triton.testing import do_bench
    out = {}
    for name, p in model.named_parameters():
        shape = tuple(p.shape)
        if p.dim() != 2 or str(shape) in out or "embed" in name:
            continue
        x = torch.randn(1, shape[1], device="cuda", dtype=p.dtype)
        out[str(shape)] = round(p.numel() * p.element_size() / do_bench(lambda: torch.nn.functional.linear(x, p))
                                / 1e9, 2)
    return out


class PipespecRunner:
    def __init__(self, name: str, k: int, spec_extra: dict | None = None, **kw):
        """`spec_extra`: more speculative_config keys (a draft vocabulary) when k > 0."""
        spec = {"method": "mtp", "num_speculative_tokens": k, **(spec_extra or {})} if k else None
        self.name, self.k = name, k
        self.llm = LLM(device="cuda", speculative_config=spec, **kw)
        self.graphs = self.llm.engine.executor.stage.graphs

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
        """(seconds, drafts, accepted draft tokens) of one generate call."""
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        before = dict(self.llm.stats().get("spec_decode", {}))
        secs = _sync_time(lambda: self.llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                    use_tqdm=False))
        after = self.llm.stats().get("spec_decode")
        if not after:
            return secs, 0, 0
        return (secs, after["num_drafts"] - before.get("num_drafts", 0),
                after["num_accepted_tokens"] - before.get("num_accepted_tokens", 0))

    def close(self):
        self.graphs = None           # the graphs hold the stage, and with it the KV cache
        self.llm.shutdown()
        self.llm = None
        torch.cuda.empty_cache()


class TransformersRunner:
    def __init__(self, name: str, model, pad_id: int, compiled: bool = False):
        self.name, self.k, self.model, self.pad_id = name, 0, model, pad_id
        self.compiled = compiled

    def run(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device="cuda")
        mask = (torch.arange(width, device="cuda")[None, :] >= torch.tensor(
            [width - len(p) for p in prompts], device="cuda")[:, None]).long()
        kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=self.pad_id)
        if self.compiled:   # a static cache makes generate compile the decode step (CUDA graphs included)
            kw["cache_implementation"] = "static"
        with torch.inference_mode():
            secs = _sync_time(lambda: self.model.generate(input_ids=ids, attention_mask=mask, **kw))
        return secs, 0, 0

    def close(self):
        self.model = None


def measure(runners, groups, new_tokens, repeats, table, model, peer_name):
    """Each runner generates every group of prompts in turn (a group is one batch); tokens/s is all
    tokens over all time, median over repeats."""
    batch = len(groups[0])
    for r in runners:                     # warm-up (and compile) on the timed shapes
        for g in groups:
            r.run(g, new_tokens)
    speed = {r.name: [] for r in runners}
    accept = {r.name: [] for r in runners}
    for _ in range(repeats):
        for r in runners:
            runs = [r.run(g, new_tokens) for g in groups]
            secs, drafts, accepted = (sum(x) for x in zip(*runs))
            speed[r.name].append(sum(len(g) for g in groups) * new_tokens / secs)
            if drafts:
                accept[r.name].append(1 + accepted / drafts)
    peer = statistics.median(speed[peer_name])
    for r in runners:
        tps = statistics.median(speed[r.name])
        row = {"model": model, "batch": batch, "engine": r.name, "k": r.k, "tokens_per_s": round(tps, 1),
               "acceptance_length": round(statistics.median(accept[r.name]), 2) if accept[r.name] else None,
               "vs_" + peer_name: round(tps / peer, 2)}
        graphs = getattr(r, "graphs", None)
        if graphs is not None:         # the device's share of a step: graph replays alone
            row.update(time_replay(r.llm.engine.executor.stage, batch))
        table.append(row)
        print(json.dumps(row), flush=True)


def smollm2(args, table):
    from transformers import AutoModelForCausalLM

    from pipespec.checkpoint.source import default_model_path

    share = dict(gpu_memory_utilization=0.12, max_num_seqs=64)
    engines = {k: PipespecRunner(f"pipespec K={k}" if k else "pipespec", k, **share) for k in (0, 1, 2, 3)}
    eager = PipespecRunner("pipespec eager", 0, enforce_eager=True, **share)
    # the same engine scheduling synchronously: async scheduling's peer (the K > 0 engines overlap too)
    sync = PipespecRunner("pipespec sync", 0, async_scheduling=False, **share)
    tok = engines[0].llm.get_tokenizer()
    chats = chat_ids(tok)
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.bfloat16).cuda().eval()
    pad = tok.eos_token_ids[0] if hasattr(tok, "eos_token_ids") else 0
    hf_eager = TransformersRunner("transformers eager", hf, pad)
    for batch in args.batch:
        # batch 1: four prompts one after another (acceptance varies by prompt); else one batch
        groups = [[c] for c in chats[:4]] if batch == 1 else [[chats[i % len(chats)] for i in range(batch)]]
        runners = ([hf_eager, eager, sync, *engines.values()] if batch == 1 else
                   [hf_eager, sync, engines[0], engines[2]])
        measure(runners, groups, args.new_tokens, args.repeats, table, "SmolLM2-135M", "transformers eager")
    if not args.skip_compile:
        # one prompt: each new prompt length would make the static-cache graph recompile
        compiled = TransformersRunner("transformers static+compile", hf, pad, compiled=True)
        measure([compiled, engines[0], engines[2], engines[3]], [[chats[0]]], args.new_tokens, args.repeats,
                table, "SmolLM2-135M", "transformers static+compile")
        compiled.close()
    hf_eager.close()
    for r in [eager, sync, *engines.values()]:
        r.close()
    del hf
    torch.cuda.empty_cache()


def llama8b(args, table):
    from tokenizers import Tokenizer, models
    from transformers import AutoModelForCausalLM, LlamaConfig

    folder = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    cfg = LlamaConfig(**LLAMA3_8B, bos_token_id=1, eos_token_id=2)
    cfg.save_pretrained(folder)
    vocab = {f"t{i}": i for i in range(LLAMA3_8B["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2", "bos_token": "t1"}))

    bandwidth = copy_bandwidth()
    shape = dict(model=str(folder), load_format="dummy", gpu_memory_utilization=0.3, max_num_seqs=64,
                 max_model_len=2048)
    engine = PipespecRunner("pipespec", 0, **shape)
    sync = PipespecRunner("pipespec sync", 0, async_scheduling=False, **shape)     # async scheduling's peer
    params = dict(engine.llm.engine.executor.stage.model.named_parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    # what a batch-1 step reads: every weight but the embedding table, of which it reads one row
    read_bytes = sum(p.numel() * p.element_size() for name, p in params.items() if "embed" not in name)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    hf_eager = TransformersRunner("transformers eager", hf, 0)
    g = torch.Generator().manual_seed(0)
    for batch in args.batch:
        prompts = [torch.randint(3, 32000, (64,), generator=g).tolist() for _ in range(batch)]
        measure([hf_eager, sync, engine], [prompts], args.new_tokens, args.repeats, table,
                "Llama-3-8B-shape (random)", "transformers eager")
        if batch == 1 and args.profile:     # where a batch-1 step's host time goes
            import cProfile
            import io
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            engine.run(prompts, args.new_tokens)
            prof.disable()
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
            print(text.getvalue(), flush=True)
        if batch == 1 and args.kernel_profile:     # where a batch-1 step's GPU time goes, kernel by kernel
            from kernel_profile import kernel_profile
            print(json.dumps(kernel_profile(lambda: engine.run(prompts, args.new_tokens), args.new_tokens, top=30)),
                  flush=True)
    roofline = bandwidth / weight_bytes          # steps (= tokens at batch 1) per second
    gemv = gemv_bandwidth(engine.llm.engine.executor.stage.model)
    row = next(r for r in table if r["model"].startswith("Llama") and r["batch"] == 1 and r["engine"] == "pipespec")
    read_roofline = bandwidth / read_bytes
    info = {"copy_bandwidth_TBps": round(bandwidth / 1e12, 2), "weight_GB": round(weight_bytes / 1e9, 2),
            "roofline_tokens_per_s_batch1": round(roofline, 1),
            "pipespec_fraction_of_roofline": round(row["tokens_per_s"] / roofline, 3),
            "read_GB_per_step": round(read_bytes / 1e9, 2),
            "pipespec_fraction_of_read_roofline": round(row["tokens_per_s"] / read_roofline, 3),
            "graph_replay_fraction_of_roofline": round(1e3 / roofline / row["forward_gpu_ms"], 3),
            "graph_replay_fraction_of_read_roofline": round(1e3 / read_roofline / row["forward_gpu_ms"], 3),
            "batch1_matmul_TBps": gemv}
    print(json.dumps(info), flush=True)
    engine.close()
    sync.close()
    return info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--skip-compile", action="store_true")
    ap.add_argument("--skip-8b", action="store_true")
    ap.add_argument("--skip-smollm2", action="store_true")
    ap.add_argument("--profile", action="store_true", help="cProfile one batch-1 8B run (host time)")
    ap.add_argument("--kernel-profile", action="store_true", help="kernel times of one batch-1 8B run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    table: list[dict] = []
    out = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "new_tokens": args.new_tokens, "repeats": args.repeats}
    if not args.skip_smollm2:
        smollm2(args, table)
    if not args.skip_8b:
        out["roofline"] = llama8b(args, table)
    out["rows"] = table
    print_table(table, {"model": lambda r: r["model"], "batch": lambda r: r["batch"], "engine": lambda r: r["engine"],
                        "K": lambda r: r["k"], "tokens/s": lambda r: r["tokens_per_s"],
                        "acceptance length": lambda r: r["acceptance_length"] or "-",
                        "vs peer": lambda r: next((v for key, v in r.items() if key.startswith("vs_")), None)})
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
