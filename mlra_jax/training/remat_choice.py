"""`remat="auto"`: the least recomputation whose training step fits the device's memory.

Rematerialization trades compute for memory: `none` keeps every activation the backward needs;
`dots_attn_qkv` keeps the projections, the attention kernel's results and its inputs (recomputing the norms
and the SwiGLU product); `dots_attn_kv` the same but the queries (recomputing their RoPE too); `dots_attn`
recomputes the elementwise work and the latent variants' per-head up-projection of keys and values; `dots` the
attention too; `full` the whole layer. Auto takes the first of these (in that order) whose estimated
per-device peak fits `MEMORY_FRACTION` of the device's memory:

    state (weights, AdamW moments, gradients, their running sum, the compute-dtype weights; training.state)
    + layers x (the activations one layer saves for its backward + its input)
    + one layer's backward workspace (the MLRA attention kernel's stored dS tiles, where it stores them)
    + the cross-entropy's working set (one chunk's logits, its cotangent, the embedding's gradient)

A layer's saved activations are traced, not guessed: JAX lists the residuals of one block under each policy
at the per-device micro-batch (`saved_residuals`), with the attention kernel that this backend runs. A
device that reports no memory limit (the CPU) takes `none`.

The estimate runs above XLA's own accounting of the compiled step (7-14% on H100s). Where it misses the budget
by less than that, on a device with an allocator (a GPU or TPU, not a topology compiled for ahead of time), the
step is compiled and XLA's count decides: the full MLRA-4 with FSDP over 2 x H100 then takes 8 sequences per
GPU under dots_attn (estimated 70.7 GiB, compiled 66.2 GiB of 72.8) instead of 6.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax.attention.mlra_kernel import backward_workspaces
from mlra_jax.config import Experiment, ModelConfig
from mlra_jax.model import REMAT_POLICIES, Block, default_positions
from mlra_jax.params import compute_params
from mlra_jax.tpu_topology import chip_for_device

log = logging.getLogger(__name__)

REMAT_ORDER = ("none", "dots_attn_qkv", "dots_attn_kv", "dots_attn", "dots", "full")  # least recomputation first
# The policies whose backward reruns neither the attention kernel nor a projection (dots_attn: only the latent
# variants' batched up-projection of keys and values, besides the elementwise work)
LIGHT_POLICIES = REMAT_ORDER[:4]
# Of the device's memory, the rest left for workspaces and fragmentation. The estimate itself runs above XLA's own
# accounting of the compiled step: by 3-5 GiB (8-14%) for the 8-layer proxies of the 2.9B models on an H100.
MEMORY_FRACTION = 0.9
# An estimate over the budget by at most this factor is checked by compiling the step (where the device allows):
# estimates ran 7-14% above XLA's count (full MLRA-4 and MLA with FSDP, 2 x H100; the 8-layer proxies, one H100).
CONFIRM_MARGIN = 1.15
# Of the allocator's limit, what XLA's count of a compiled step (arguments and temporaries) may take; the rest is
# for cuDNN's and NCCL's workspaces and fragmentation. The full MLRA-4 step above ran at 66.2 of 72.8 GiB (91%).
COMPILED_FRACTION = 0.95
# The most steps auto compiles to decide (each takes as long as the run's own compile); past them the estimate
# decides. The full MLA with FSDP over 2 x H100 took four: one remat policy and three with the weights held.
MAX_CONFIRMATIONS = 6
# The bytes XLA's compiled step takes per device under a remat policy, or None where it cannot say.
CompiledBytes = Callable[[str], "int | None"]


def saved_activation_bytes(cfg: ModelConfig, batch: int, seq_len: int, remat: str) -> int:
    """Bytes one block saves for its backward at `batch` sequences of `seq_len` under a remat policy, besides
    its weights and its input; never less than a policy that recomputes more saves."""
    lighter = REMAT_ORDER[REMAT_ORDER.index(remat) + 1 :]
    return max(
        [_residual_bytes(cfg, batch, seq_len, remat)]
        + [_residual_bytes(cfg, batch, seq_len, other) for other in lighter]
    )


def _residual_bytes(cfg: ModelConfig, batch: int, seq_len: int, remat: str) -> int:
    return _traced_layer(cfg, batch, seq_len, remat)[0]


def backward_workspace_bytes(cfg: ModelConfig, batch: int, seq_len: int) -> int:
    """Bytes that one block's backward holds beyond its saved activations at `batch` sequences of `seq_len`, for the
    duration of that block's backward only: the MLRA attention kernel's stored dS tiles, where it stores them
    (attention.mlra_kernel.backward_workspaces); the same under every remat policy."""
    return _traced_layer(cfg, batch, seq_len, "none")[1]


@functools.cache
def _traced_layer(cfg: ModelConfig, batch: int, seq_len: int, remat: str) -> tuple[int, int]:
    """(the residuals' bytes, the backward's largest workspace) of one block traced under a remat policy."""
    from jax._src.ad_checkpoint import saved_residuals  # what jax.ad_checkpoint.print_saved_residuals prints

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Block(cfg, rngs=nnx.Rngs(0))))
    params = nnx.to_pure_dict(state)
    if cfg.dtype != jnp.float32:
        params = jax.eval_shape(lambda p: compute_params(p, cfg.dtype), params)
    x = jax.ShapeDtypeStruct((batch, seq_len, cfg.n_embd), jnp.float32)
    positions = default_positions(jnp.zeros((batch, seq_len), jnp.int32))

    def layer(p: dict[str, Any], h: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, p)(h, positions)

    if remat != "none":
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
    with backward_workspaces() as workspaces:
        residuals = saved_residuals(layer, params, x)
    saved = sum(
        math.prod(aval.shape) * aval.dtype.itemsize
        for aval, source in residuals
        if materialized(source, aval.dtype, cfg.dtype)
    )
    return saved, max(workspaces, default=0)


# Elementwise results that XLA fuses into the backward's consumers (recomputed from what they were made of)
# rather than keeping: JAX lists them as residuals, but they take no memory of their own.
_FUSED_ELEMENTWISE = frozenset(
    {
        "mul",
        "add",
        "sub",
        "div",
        "neg",
        "exp",
        "log",
        "rsqrt",
        "sqrt",
        "tanh",
        "logistic",
        "max",
        "min",
        "select_n",
        "integer_pow",
        "square",
        "broadcast_in_dim",
        "cos",
        "sin",
        "jitted function 'silu'",
    }
)


def materialized(source: str, dtype: jnp.dtype, compute_dtype: jnp.dtype) -> bool:
    """Whether a residual (saved_residuals' description of its source) holds memory of its own through the
    backward: products, kernel outputs, layout changes and the compute-dtype copies that feed products; not the
    layer's arguments, constants, or fused elementwise values."""
    if source.startswith("named "):
        return True  # a value a policy keeps by name (the attention kernel's inputs)
    if not source.startswith("output of "):
        return False  # an argument (the weights, the layer's input), a literal or a constant
    producer = source[len("output of ") :].split(" from ")[0]
    if producer == "convert_element_type":
        return dtype == compute_dtype != jnp.float32  # the low-precision operands of the products
    return producer not in _FUSED_ELEMENTWISE


def step_bytes(experiment: Experiment, fixed_bytes: int, batch: int, remat: str) -> int:
    """The estimated per-device peak of a train step: `fixed_bytes` of state, the layers' saved activations and
    inputs at `batch` sequences per device, one block's backward workspace, and the cross-entropy's working set."""
    cfg, train = experiment.model, experiment.train
    layer_input = batch * train.seq_len * cfg.n_embd * 4
    chunk = train.loss_chunk if 0 < train.loss_chunk < train.seq_len else train.seq_len
    loss = 3 * batch * chunk * cfg.vocab_size * 4 + 2 * cfg.vocab_size * cfg.n_embd * 4 + layer_input
    per_layer = saved_activation_bytes(cfg, batch, train.seq_len, remat) + layer_input
    workspace = backward_workspace_bytes(cfg, batch, train.seq_len)  # one block's backward at a time
    return fixed_bytes + cfg.n_layer * per_layer + workspace + loss


def device_memory(device: jax.Device) -> int | None:
    """The bytes the device's allocator may use; a TPU compiled for ahead of time (no allocator here) its chip's
    HBM; None where neither is known (CPU)."""
    try:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    except jax.errors.JaxRuntimeError:  # a compile-only device (tpu_topology)
        stats = None
    if stats and stats.get("bytes_limit"):
        return stats["bytes_limit"]
    chip = chip_for_device(device)
    return chip.hbm_bytes if chip is not None else None


def compiles_to_confirm(device: jax.Device) -> bool:
    """Whether auto may compile a step to check a choice: a device with an allocator (no CPU, no topology)."""
    if device.platform == "cpu":
        return False
    try:
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    except jax.errors.JaxRuntimeError:  # a compile-only device (tpu_topology)
        return False
    return bool(stats and stats.get("bytes_limit"))


def choose_remat(
    experiment: Experiment, fixed_bytes: int, batch: int, memory: int | None, compiled: CompiledBytes | None = None
) -> tuple[str, str]:
    """(policy, reason): the first of REMAT_ORDER whose step_bytes fits MEMORY_FRACTION of `memory`, or, with
    `compiled`, whose estimate misses it by at most CONFIRM_MARGIN and whose compiled step fits COMPILED_FRACTION."""
    if memory is None:
        return "none", "the device reports no memory limit"
    budget = MEMORY_FRACTION * memory
    estimates = []
    for remat in REMAT_ORDER:
        need = step_bytes(experiment, fixed_bytes, batch, remat)
        estimates.append(f"{remat} {need / 2**30:.1f} GiB")
        if need <= budget:
            return remat, f"estimated {', '.join(estimates)} of {budget / 2**30:.1f} GiB usable"
        actual = compiled(remat) if compiled is not None and need <= CONFIRM_MARGIN * budget else None
        if actual is not None:
            estimates[-1] += f" (compiled {actual / 2**30:.1f} GiB)"
            if actual <= COMPILED_FRACTION * memory:
                return remat, (
                    f"estimated {', '.join(estimates)}: the compiled step fits {COMPILED_FRACTION:.0%} of "
                    f"{memory / 2**30:.1f} GiB"
                )
    return "full", (
        f"nothing fits: estimated {', '.join(estimates)} of {budget / 2**30:.1f} GiB usable; lower "
        f"train.micro_batch_size or train.max_micro_batch_per_device, or shard over more devices"
    )


def resolve_remat(
    experiment: Experiment,
    fixed_bytes: int,
    batch: int,
    device: jax.Device,
    smaller_batches: tuple[int, ...] = (),
    compiled_bytes: Callable[[Experiment], int | None] | None = None,
    fsdp: bool = False,
) -> Experiment:
    """The experiment with remat="auto" replaced by choose_remat's policy (logged); others as they are.

    When the micro-batch came from the per-device cap and `batch` sequences per device fit only under a policy
    that reruns products or kernels (`dots`, `full`), the largest of `smaller_batches` (per device) that fits
    under a lighter one (LIGHT_POLICIES) is taken instead: rerunning the attention or the whole forward
    costs more than a smaller micro-batch. Full 2.9B MLRA-4 with FSDP on 2 GPUs (global batch 120): 6 sequences
    per device under dots_attn_kv ran as fast as 4 under none and 1.1% faster than 6 under dots_attn; 8 under
    dots ran out of memory on an H100 (experiments/results/train_fsdp_h200x2_remat.json, train_fsdp_h100x2.json).

    `compiled_bytes(candidate)`: XLA's per-device count of the candidate experiment's compiled step, for
    choose_remat to confirm estimates near the budget (only on a device that compiles_to_confirm). With `fsdp`
    (an FSDP mesh) and mesh.fsdp_gather "auto", a choice that recomputes under gradient accumulation is then
    compiled with the weights gathered once per step (mesh.fsdp_gather="step"), under it and each heavier light
    policy in turn, and the first that fits COMPILED_FRACTION is taken: on 2 x H100 with the full MLA, 8 per GPU
    under dots_attn gathered once per step ran 3.4% faster than under dots_attn_qkv gathered in each
    micro-batch (experiments/results/train_fsdp_confirmed.json)."""
    if experiment.model.remat != "auto":
        return experiment
    memory = device_memory(device)
    confirm = None
    if compiled_bytes is not None and compiles_to_confirm(device):
        confirm = at_most(MAX_CONFIRMATIONS, compiled_bytes)

    def choice(remat: str, per_device: int) -> Experiment:
        train = experiment.train
        if per_device != batch:
            train = dataclasses.replace(train, micro_batch_size=train.micro_batch_size // batch * per_device)
        return dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, remat=remat), train=train)

    def choose(per_device: int) -> tuple[str, str]:
        compiled = None if confirm is None else lambda remat: confirm(choice(remat, per_device))
        return choose_remat(experiment, fixed_bytes, per_device, memory, compiled)

    remat, reason = choose(batch)
    chosen = batch
    if remat not in LIGHT_POLICIES:
        for smaller in sorted(smaller_batches, reverse=True):
            lighter, why = choose(smaller)
            if lighter in LIGHT_POLICIES:
                remat, reason, chosen = lighter, why, smaller
                break
    log.info("remat=auto chose %s for %d sequences per device (%s)", remat, chosen, reason)
    resolved = choice(remat, chosen)
    if confirm is None or not fsdp or resolved.mesh.fsdp_gather != "auto" or resolved.train.accumulation_steps == 1:
        return resolved
    if remat not in LIGHT_POLICIES[1:]:  # none gathers once per step anyway; dots and full are not tried held
        return resolved
    heavier = [choice(policy, chosen) for policy in LIGHT_POLICIES[LIGHT_POLICIES.index(remat) :]]
    return held_weights_choice(heavier, confirm, memory) or resolved


def at_most(count: int, compiled_bytes: Callable[[Experiment], int | None]) -> Callable[[Experiment], int | None]:
    """compiled_bytes for the first `count` calls, then None (the estimate decides)."""
    calls = 0

    def limited(candidate: Experiment) -> int | None:
        nonlocal calls
        calls += 1
        if calls > count:
            if calls == count + 1:
                log.info("remat=auto: %d steps compiled; the estimates decide the rest", count)
            return None
        return compiled_bytes(candidate)

    return limited


def held_weights_choice(
    candidates: list[Experiment], compiled_bytes: Callable[[Experiment], int | None], memory: int
) -> Experiment | None:
    """The first candidate whose step, compiled with FSDP's weights gathered once per step, fits COMPILED_FRACTION
    of `memory` (with mesh.fsdp_gather="step"); None where none does."""
    for candidate in candidates:
        held = dataclasses.replace(candidate, mesh=dataclasses.replace(candidate.mesh, fsdp_gather="step"))
        actual = compiled_bytes(held)
        fits = actual is not None and actual <= COMPILED_FRACTION * memory
        log.info(
            "remat=auto: %s with the weights gathered once per step compiled to %s GiB (%s)",
            candidate.model.remat,
            "?" if actual is None else f"{actual / 2**30:.1f}",
            "taken" if fits else f"over {COMPILED_FRACTION:.0%} of {memory / 2**30:.1f} GiB",
        )
        if fits:
            return held
    return None
