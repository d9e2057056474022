"""Decoding: KV caches, prefill and decode steps, sampling and batched generation."""
