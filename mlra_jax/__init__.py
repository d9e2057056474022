"""mlra_jax: JAX/Flax pretraining and serving for the attention variants of the MLRA paper."""

from mlra_jax.backends import skip_absent_tpu

__version__ = "0.1.0"

skip_absent_tpu()  # no TPU runtime (and none of its error lines) on a machine without a TPU
