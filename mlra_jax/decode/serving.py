"""The serving path that `Generator.generate` and `mlra generate` run.

* Weights are cast once to the compute dtype (norm scales and the embedding table stay float32,
  as the model reads them; the tied head gets its own copy in the compute dtype) and split into
  one pytree per layer, so a step reads each weight once, as stored. The MLP's hidden width is padded
  to a multiple of 128 (layouts.padded_mlp). Without tensor parallelism the serving layer holds the products'
  weights in the layouts its steps read best (decode.layouts: the products of the same input merged into one,
  the latent family's W_UK and W_UV head-major) and runs the blocks on copies of the modules without them
  (decode.serving_block); under tensor parallelism the latent family's blocks run as one shard_map each over
  weights laid out per device (decode.region_block), the other variants' modules as trained (MLRA's as well
  with region_block.REGION_BLOCKS off: queries and output projection whole on every device of `tensor`,
  layouts.tensor_parallel_weights). A one-row product runs on two rows
  (layers.two_rows), and a chain of products (the MLP; the latent queries; W_UV and the output projection)
  on copies of the row, sliced once at its end (layers.row_copies).
* The cache is `LayerCaches`: one buffer per layer and cached tensor, donated to every jitted step
  and updated in place (the layers are unrolled; a layer scan over a stacked cache re-emits and
  copies the whole cache every step).
* The cache's capacity grows in buckets (`capacity_bucket`: powers of two and 1.5x them), so a
  step compiles once per bucket, not per length, and a short context attends over a short buffer,
  not max_len. Crossing a bucket copies the cache once into the next one.
* Prompts are prefilled in chunks of at most `prefill_chunk` tokens through the cache (the
  left padding rounded up to whole chunks), so a long prompt never forms [T, T] scores.
* Only the last position's logits are computed, in prefill too.
* With attention_impl="auto", decode steps of the latent family take the Pallas kernel where it
  runs (attention.latent_kernels.use_kernel: Hopper GPUs, TPUs) and XLA elsewhere.
* Decode steps of one sequence run on the row-product kernels where they run (row_kernels="auto": NVIDIA GPUs,
  one device; decode.row_step): each product with its norm, residual add or SwiGLU inside, the latent
  family's cache write, queries and output as one kernel each. The held weights are then stored out-major
  ([out, in]), which the XLA path (prefill, larger batches) reads as well.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlra_jax.attention.fused import log_once
from mlra_jax.config import ModelConfig
from mlra_jax.decode import layouts, region_block, row_step, serving_block
from mlra_jax.kv_cache import SLOT_MULTIPLE, LayerCaches, init_layer_caches, layer_cache_shardings, slot_mask
from mlra_jax.layers import einsum
from mlra_jax.model import Transformer
from mlra_jax.params import compute_params
from mlra_jax.platform import target_platform

MIN_BUCKET = 256  # the smallest cache capacity (slots)
# XLA options of serving calls on GPUs (training keeps XLA's defaults). DotMerger turns dots that share an
# input (the SwiGLU's two input projections, the attention's projections of x) into one dot against a
# concatenation of their weights, made anew on every call: a copy of about half of all weights per step
# (H100, 2.9B MLRA-4 at 8K tokens: 1.9 ms of a 7.1 ms batch-1 step, the profile's "wrapped_concatenate").
SERVING_COMPILER_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}
# Calls of more tokens than this take cuBLAS for their GEMMs, fewer XLA's Triton GEMM fusions. Measured on an
# H100 (2.9B MLRA-4, 8K tokens): at 1 token a step takes 3.3 ms with Triton and 3.9 with cuBLAS, whose skinny
# GEMMs split K and add a reduction kernel each; at 64 tokens the SwiGLU's input projections take 1.46 ms
# with Triton and 1.20 with cuBLAS.
TRITON_GEMM_ROWS = 16
PREFILL_CHUNK = 512  # prompt tokens per prefill call
# How serving calls under tensor parallelism all-reduce on GPUs: "nccl" (XLA's default) or "one_shot" (XLA's
# one-shot all-reduce kernel, ONE_SHOT_ALL_REDUCE_OPTION: each device reads its peers' buffers in one kernel).
# One A/B on 4 x H100 (2.9B MLRA-4 at TP=4, batch 64, 2K) ran 5.18 ms per step against 5.60 with NCCL; the
# option is experimental in XLA ("unsupported"), so it stays a choice until repeated A/Bs confirm it.
TP_ALL_REDUCE = "nccl"
ONE_SHOT_ALL_REDUCE_OPTION = "xla_gpu_unsupported_use_all_reduce_one_shot_kernel"


def serving_compiler_options(rows: int, tensor_parallel: bool = False) -> dict[str, Any] | None:
    """The XLA options of a serving call of `rows` tokens (batch x tokens per sequence) on this backend:
    on GPUs SERVING_COMPILER_OPTIONS, with Triton GEMMs off above TRITON_GEMM_ROWS rows and, for a call under
    tensor parallelism with TP_ALL_REDUCE "one_shot", XLA's one-shot all-reduce kernel."""
    if target_platform() != "gpu":
        return None
    options = SERVING_COMPILER_OPTIONS | ({"xla_gpu_enable_triton_gemm": False} if rows > TRITON_GEMM_ROWS else {})
    if tensor_parallel and TP_ALL_REDUCE == "one_shot":
        options = options | {ONE_SHOT_ALL_REDUCE_OPTION: True}
    return options


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def capacity_bucket(slots: int, limit: int, minimum: int = MIN_BUCKET) -> int:
    """The smallest capacity minimum * 2^k or 1.5 * minimum * 2^k (multiples of SLOT_MULTIPLE) that holds
    `slots`, capped at `limit`: about two compiled steps per doubling of the context, and a buffer at most
    1.5x the slots in use (beyond the minimum)."""
    power = round_up(max(minimum, SLOT_MULTIPLE), SLOT_MULTIPLE)
    while True:
        for capacity in (power, round_up(power * 3 // 2, SLOT_MULTIPLE)):
            if capacity >= slots:
                return min(capacity, round_up(limit, SLOT_MULTIPLE))
        power *= 2


@dataclasses.dataclass
class Session:
    """A batch being decoded: its caches (replaced by every step, which donates them) and the slots
    written so far (the host's copy of caches.index, so that no step waits on the device for it)."""

    caches: LayerCaches
    written: int
    limit: int  # the largest capacity the caches may grow to


class ServingModel:
    """A model prepared for decoding: weights cast and split per layer; jitted prefill-chunk and decode
    steps over LayerCaches; `traces` counts the compilations by (kind, tokens per call, capacity)."""

    def __init__(
        self,
        model: Transformer,
        mesh: jax.sharding.Mesh | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        min_bucket: int = MIN_BUCKET,
        row_kernels: str = "auto",
    ):
        """row_kernels: decode steps of one sequence on the row-product kernels (decode.row_step): "auto" where
        they run (NVIDIA GPUs, one device), "on" (a ValueError where they cannot), "off", or "interpret" (Pallas
        interpret mode, for tests on CPU)."""
        self.cfg, self.mesh = model.config, mesh
        self.prefill_chunk, self.min_bucket = prefill_chunk, min_bucket
        self.rows, self.rows_interpret = use_row_kernels(row_kernels, self.cfg, mesh), row_kernels == "interpret"
        graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
        shell = nnx.merge(graphdef, params)
        blocks = compute_params(params["blocks"], self.cfg.dtype)
        blocks = {**blocks, "mlp": layouts.padded_mlp(blocks["mlp"])}
        # Without tensor parallelism the weights that decode steps read best in other layouts are held here
        # (decode.layouts) and the blocks run on a shell of the modules without them; the latent family under TP
        # runs each block as one region with each device's weights laid out for it (decode.region_block); other
        # variants under TP run the modules as trained.
        tp = 1 if mesh is None else mesh.shape.get("tensor", 1)
        self.held, self.region = tp == 1, region_block.serves(self.cfg, mesh)
        if self.held:
            layers = {"block": layouts.module_weights(blocks), **layouts.held_weights(blocks, out_major=self.rows)}
            self.block_def = nnx.split(layouts.serving_shell(shell.blocks))[0]
        elif self.region:
            layers = {
                "block": layouts.module_weights(blocks, region_block.ALSO_HELD),
                "region": region_block.region_weights(blocks, self.cfg, mesh),
            }
            self.block_def = nnx.split(layouts.serving_shell(shell.blocks, region_block.ALSO_HELD))[0]
        else:
            layers = {"block": layouts.tensor_parallel_weights(blocks, self.cfg, mesh)}
            if layouts.projects_in_region(self.cfg, tp):
                shell.blocks.attn.project_in_region = True
            self.block_def = nnx.split(shell.blocks)[0]
        self.embed_def = nnx.split(shell.embed)[0]
        self.norm_def = nnx.split(shell.final_norm)[0]
        self.weights = serving_weights(params, layers, self.cfg.dtype, self.cfg.n_layer)
        self.traces: collections.Counter = collections.Counter()
        self._calls: dict[tuple, Callable] = {}  # (absorbed, few rows, sampler, steps) -> jitted call
        self._grow = jax.jit(self._grown, static_argnums=(1,))  # a new shape: nothing to donate into

    def compiled(
        self, absorbed: bool, tokens_shape: tuple[int, int], sampler: Callable | None = None, steps: int = 1
    ) -> Callable:
        """The jitted forward (absorbed: a decode step, else a prefill chunk) for tokens [B, T], with the
        compiler options of B x T rows (serving_compiler_options); with a sampler, `steps` decode steps that
        sample the next tokens in the same call (_sampled_steps; one compilation per sampler object and count)."""
        rows = tokens_shape[0] * tokens_shape[1]
        key = absorbed, rows <= TRITON_GEMM_ROWS, sampler, steps
        if key not in self._calls:
            fn = (
                functools.partial(self._forward, absorbed=absorbed)
                if sampler is None
                else functools.partial(self._sampled_steps, sampler=sampler, steps=steps)
            )
            tensor_parallel = self.mesh is not None and self.mesh.shape.get("tensor", 1) > 1
            options = serving_compiler_options(rows, tensor_parallel)
            self._calls[key] = jax.jit(fn, donate_argnums=(2,), compiler_options=options)
        return self._calls[key]

    # -- the pure forward ------------------------------------------------------------------------
    def _forward(
        self, weights: dict[str, Any], tokens: jax.Array, caches: LayerCaches, absorbed: bool
    ) -> tuple[jax.Array, LayerCaches]:
        """Float32 logits [B, V] of the last of tokens [B, T], written into the caches at caches.index."""
        self.traces["step" if absorbed else "prefill", tokens.shape[1], caches.max_len] += 1
        positions, mask = slot_mask(caches, tokens.shape[1])
        plans = dict(caches.plans)
        x = nnx.merge(self.embed_def, weights["embed"])(tokens)
        final_norm = nnx.merge(self.norm_def, weights["final_norm"])
        rows = absorbed and self.rows and tokens.shape == (1, 1)
        if rows:  # one token of one sequence: its residual row through the row kernels
            x, rope = x[0, 0], row_step.rope_of(self.cfg, positions)
        layers = []
        for layer_weights, cache in zip(weights["layers"], caches.layers):
            if self.region:
                x, cache = region_block.block_step(
                    self.block_def, layer_weights, x, positions, cache, mask, caches.index, plans, absorbed, self.mesh
                )
                layers.append(cache)
                continue
            block = nnx.merge(self.block_def, layer_weights["block"])
            if rows:
                x, cache = row_step.block_step(
                    block, layer_weights, x, cache, positions, mask, caches.index, plans, rope, self.rows_interpret
                )
            elif self.held:
                x, cache = serving_block.block_step(
                    block, layer_weights, x, positions, cache, mask, caches.index, plans, absorbed, self.rows
                )
            else:
                x, cache = block.cached(x, positions, cache, mask, caches.index, plans, absorbed)
            layers.append(cache)
        if rows:
            logits = row_step.head_logits(final_norm, weights["head"], x, self.rows_interpret)
        else:
            logits = einsum(
                "bd,vd->bv",
                final_norm(x[:, -1]).astype(self.cfg.dtype),
                weights["head"],
                preferred_element_type=jnp.float32,
            )
        return logits, dataclasses.replace(caches, layers=tuple(layers), index=caches.index + tokens.shape[1])

    def _sampled_steps(
        self,
        weights: dict[str, Any],
        tokens: jax.Array,
        caches: LayerCaches,
        key: jax.Array,
        sampler: Callable[[jax.Array, jax.Array], jax.Array],
        steps: int,
    ) -> tuple[jax.Array, jax.Array, LayerCaches]:
        """`steps` decode steps from tokens [B], each sampling the next tokens: (the tokens drawn [B, steps], the
        next key, caches). Each draw uses a key split from the running key, as separate calls would. The steps run
        in one XLA loop, so that its command buffers (CUDA graphs) are recorded once per call: a call dispatched
        while the last one still runs gets its buffers elsewhere, and XLA records every command buffer whose
        buffers moved again (ServingModel.sampled_steps)."""

        def step(carry, _):
            tokens, key, caches = carry
            logits, caches = self._forward(weights, tokens[:, None], caches, absorbed=True)
            key, draw_key = jax.random.split(key)
            tokens = sampler(logits, draw_key)
            return (tokens, key, caches), tokens

        if steps == 1:  # no loop: one step as it is
            (tokens, key, caches), drawn = step((tokens, key, caches), None)
            return drawn[:, None], key, caches
        (_, key, caches), drawn = jax.lax.scan(step, (tokens, key, caches), length=steps)
        return drawn.T, key, caches

    def _grown(self, caches: LayerCaches, capacity: int) -> LayerCaches:
        pad = lambda a: jnp.pad(a, [(0, 0), (0, capacity - a.shape[1])] + [(0, 0)] * (a.ndim - 2))
        layers = tuple({name: pad(a) for name, a in layer.items()} for layer in caches.layers)
        if self.mesh is not None:
            shardings = layer_cache_shardings(self.cfg, self.mesh)
            layers = tuple(
                {n: jax.lax.with_sharding_constraint(a, shardings[n]) for n, a in layer.items()} for layer in layers
            )
        return dataclasses.replace(caches, layers=layers)

    def _call(self, fn, *args):
        if self.mesh is None:
            return fn(*args)
        with jax.set_mesh(self.mesh):
            return fn(*args)

    # -- serving -----------------------------------------------------------------------------------
    def reserve(self, session: Session, slots: int) -> None:
        """Grow the caches to the bucket that holds `slots` slots, if they do not already."""
        if slots > session.caches.max_len:
            capacity = capacity_bucket(slots, session.limit, self.min_bucket)
            if capacity < slots:
                raise ValueError(f"{slots} slots exceed the cache limit of {session.limit}")
            session.caches = self._call(self._grow, session.caches, capacity)

    def prefill(
        self, tokens: np.ndarray, starts: np.ndarray, max_new_tokens: int, max_len: int
    ) -> tuple[jax.Array, Session]:
        """Left-padded prompts tokens [B, W] (sequence b starting at starts[b]) through the caches in chunks;
        the logits [B, V] of their last position and the session to decode from."""
        chunk = min(self.prefill_chunk, capacity_bucket(tokens.shape[1], self.prefill_chunk, minimum=16))
        pad = round_up(tokens.shape[1], chunk) - tokens.shape[1]
        tokens = np.pad(tokens, ((0, 0), (pad, 0)))
        starts = np.asarray(starts) + pad
        limit = round_up(max(max_len, tokens.shape[1] + max_new_tokens), SLOT_MULTIPLE)
        capacity = capacity_bucket(chunk, limit, self.min_bucket)
        caches = self._call(init_layer_caches, self.cfg, tokens.shape[0], capacity, starts, self.mesh)
        session = Session(caches, 0, limit)
        logits = None
        for begin in range(0, tokens.shape[1], chunk):
            self.reserve(session, begin + chunk)
            chunk_tokens = jnp.asarray(tokens[:, begin : begin + chunk])
            logits, session.caches = self._call(
                self.compiled(False, chunk_tokens.shape), self.weights, chunk_tokens, session.caches
            )
            session.written = begin + chunk
        return logits, session

    def step(self, tokens: jax.Array, session: Session) -> jax.Array:
        """One decode step of tokens [B, 1]: their logits [B, V]; the session's caches advance in place."""
        self.reserve(session, session.written + 1)
        logits, session.caches = self._call(self.compiled(True, tokens.shape), self.weights, tokens, session.caches)
        session.written += 1
        return logits

    def sampled_steps(
        self,
        tokens: jax.Array,
        session: Session,
        key: jax.Array,
        sampler: Callable[[jax.Array, jax.Array], jax.Array],
        steps: int = 1,
    ) -> tuple[jax.Array, jax.Array]:
        """`steps` decode steps from tokens [B], each sampling the next tokens, in one call: (the tokens drawn
        [B, steps], the next key). On GPUs a call of several steps records the step's CUDA graphs once per call
        instead of once per step (4 x H200, the 2.9B MLRA-4 at TP=4, batch 64, 2K: 3.38 ms per step in calls of 8
        against 6.12 for single steps dispatched back to back)."""
        self.reserve(session, session.written + steps)
        drawn, key, session.caches = self._call(
            self.compiled(True, (tokens.shape[0], 1), sampler, steps), self.weights, tokens, session.caches, key
        )
        session.written += steps
        return drawn, key


def use_row_kernels(mode: str, cfg: ModelConfig, mesh: jax.sharding.Mesh | None) -> bool:
    """Whether batch-1 decode steps take the row kernels (ServingModel's row_kernels)."""
    if mode not in row_step.ROW_KERNEL_MODES:
        raise ValueError(f"row_kernels={mode!r}: use one of {', '.join(row_step.ROW_KERNEL_MODES)}")
    if mode == "off":
        return False
    problem = row_step.row_kernels_problem(cfg, mesh, interpret=mode == "interpret")
    if problem is not None and mode != "auto":
        raise ValueError(
            f"row_kernels={mode!r}: the row kernels cannot serve this model: {problem}; use row_kernels='auto' or 'off'"
        )
    if problem is not None and target_platform() == "gpu":
        log_once(f"row_kernels='auto': batch-1 decode steps run on XLA ({problem})")
    return problem is None


def serving_weights(params: dict[str, Any], layers: dict[str, Any], dtype: jnp.dtype, n_layer: int) -> dict[str, Any]:
    """The weights serving reads: `layers`, the stacked layers' weights as prepared (cast, padded, laid out),
    split into one pytree per layer; the model's other parameters cast once to `dtype` (compute_params: norm
    scales and the embedding table stay float32), and the tied head's own copy in `dtype`."""
    cast = compute_params({name: params[name] for name in ("embed", "final_norm")}, dtype)
    table = params["embed"]["embedding"]
    return {
        **cast,
        "layers": tuple(jax.tree.map(lambda a: a[i], layers) for i in range(n_layer)),
        "head": table if table.dtype == dtype else table.astype(dtype),
    }
