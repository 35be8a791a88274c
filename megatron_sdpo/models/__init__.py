"""Models built by the project itself: the tiny ~1M-parameter Qwen3 base and its tokenizer (tiny)."""
