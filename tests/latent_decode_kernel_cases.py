"""The Mosaic GPU latent decode kernel (pallas_kernels/latent_decode_gpu.py) and its split-KV merge in Pallas's GPU
interpret mode, float32, against the jnp reference: run by test_kernels.py in a pytest process of its own
(helpers.run_interpreted_cases). The GPU tests (test_kernels.py, `-m gpu`) run every layout on the GPU."""

import jax.numpy as jnp
import numpy as np
import pytest
from helpers import latent_decode_inputs
from mlra_jax.pallas_kernels import latent_decode_gpu as kernel
from mlra_jax.pallas_kernels.latent_decode_reference import reference


@pytest.mark.parametrize(
    "heads,r,blocks,cta_heads,block_kv,sms",
    [
        (128, 128, 1, 128, None, 132),  # "heads": 128 heads a CTA, a warpgroup each 64 over every tile
        (64, 128, 1, None, 64, 132),  # "tiles": the warpgroups alternate tiles, then merge their states
        (24, 512, 1, None, None, 2),  # "columns" (few SMs: no "halves"): warpgroup 0 hands P to warpgroup 1
    ],
)
def test_the_kernel_equals_the_reference(heads, r, blocks, cta_heads, block_kv, sms, monkeypatch):
    """A range that starts and ends inside KV tiles, over 2 splits (interpret mode has no TMA zero fill: the cache's
    slots are whole tiles)."""
    monkeypatch.setattr(kernel, "sm_count", lambda device=None: sms)
    args = latent_decode_inputs(heads, 64, r, blocks, 256, jnp.float32, batch=1)
    starts, ends = jnp.array([37]), jnp.array([250])
    got = kernel.latent_decode_gpu(
        *args, starts, ends, scale=0.1, splits=2, block_kv=block_kv, cta_heads=cta_heads, interpret=True
    )
    want = reference(*args, starts, ends, scale=0.1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
