"""Evaluation tasks: quantization-aware perplexity, needle retrieval, per-layer errors."""
