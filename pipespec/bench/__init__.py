"""`pipespec bench latency | throughput | serve`: measure the engine as vLLM's bench commands do.

latency     one batch of fixed input/output lengths, timed over iterations (offline engine)
throughput  many requests at once, tokens per second (offline engine)
serve       a load generator against a running OpenAI-compatible server: TTFT, TPOT, ITL
"""
