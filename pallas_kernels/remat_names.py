"""Names (jax.ad_checkpoint.checkpoint_name) that kernels give the outputs of theirs that the backward reads, so that
a remat policy can keep them: a kernel call is opaque to the policies (Mosaic GPU's sits in a custom_vmap_call), and
a policy that keeps nothing of it runs the whole kernel again in the backward. Importing this module loads no
kernel."""

MLRA_ATTENTION_RESIDUALS = ("mlra_attention_out", "mlra_attention_lse")  # its forward's output and logsumexp
