"""OpenAI-compatible HTTP server: `pipespec serve`."""
