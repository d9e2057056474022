"""mlra_jax: JAX/Flax pretraining and serving for the attention variants of the MLRA paper."""

__version__ = "0.1.0"
