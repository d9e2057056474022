"""Decoding: prefill and decode steps over the KV cache (mlra_jax.kv_cache), sampling and batched generation."""
