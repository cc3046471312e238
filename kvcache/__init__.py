"""kvcache: a prefix KV-cache daemon with RAM and disk tiers for llama.cpp models."""

__version__ = "0.1.0"
