"""Pallas kernels as pure functions (no Flax), each beside its jnp reference."""
