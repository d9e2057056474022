"""Pallas kernels as pure functions (no Flax, nothing of the library), each beside its jnp reference.

Latent decode attention (MLA, GLA, MLRA), each module importing only those above it:
  * latent_decode_reference  the plain jnp definition the kernels are tested against;
  * latent_decode_common     page-table checks, the split-KV choice and merge (`combine`);
  * latent_decode_tpu        Pallas Mosaic TPU (also run in TPU interpret mode on CPU);
  * latent_decode_gpu        Pallas Mosaic GPU for Hopper, whose split-KV merge is a kernel too.
The library chooses among them by backend and mesh (mlra_jax.attention.latent_kernels).

GQA decode attention (MHA, MQA, GQA):
  * gqa_decode_gpu           Pallas Triton flash-decoding over the cache as stored, with its jnp reference; run by
                             attention_impl="pallas" on NVIDIA GPUs (mlra_jax.attention.gqa_kernel).

Training's elementwise passes (run by model.fused_elementwise: mlra_jax.fused_elementwise), Pallas Triton:
  * add_rms_norm_gpu         the residual add with the RMSNorm after it, one pass forward and one backward;
  * swiglu_gpu               the SwiGLU product's backward (and forward) in one pass;
  * fp8_cast_gpu             an FP8 GEMM operand quantized in both layouts, with its amax, in one pass (run by
                             model.fp8_casts: mlra_jax.fp8_casts).

Training attention:
  * mlra_attention_gpu       MLRA's causal forward in Pallas Mosaic GPU (query side head-major, MLRA-2's head groups
                             inside), with its jnp reference; tested in GPU interpret mode on CPU, timed by
                             `mlra bench attention_kernels --kernels=mlra`;
  * mlra_attention_gpu_backward  its backward (dK/dV and dQ kernels) and `mlra_attention`, both under a custom VJP:
                             what the trainer runs for MLRA-2 and MLRA-4 on Hopper (mlra_jax.attention.mlra_kernel);
  * remat_names              the names that kernels give the outputs their backward reads, which remat policies keep.

Collectives:
  * peer_all_reduce_gpu      a one-shot all-reduce of small bf16 arrays among the GPUs of one host, in PTX launched
                             through jaxlib's Triton kernel call (it reads the peers' partials over NVLink), with its
                             jnp reference; run by the latent family's TP decode steps (mlra_jax.peer_exchange).

Shared: gpu_interpret (Pallas's GPU interpret mode for the Mosaic GPU kernels' CPU tests) and block_specs (the
whole-array BlockSpec of the Triton kernels).
"""
