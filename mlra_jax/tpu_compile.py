"""Compile the real train step and serving steps for a TPU slice on a machine without TPUs, and report.

`compile_train(experiment, topology)` builds the trainer's own jitted step (the experiment's mesh, shardings,
remat, micro-batching and kernels, as `train` would run it) over the slice's compile-only devices
(tpu_topology) and compiles it with the TPU compiler; nothing runs. `compile_serving` does the same for the
serving path's prefill chunk and decode step. Each gives a `CompileReport`: per-chip memory (XLA's accounting
of arguments, outputs, temporaries and generated code) against the chip's HBM, the Mosaic kernels in the
program (splash attention, the latent decode kernel: lowered for the TPU, not interpreted), XLA's cost
analysis and a roofline estimate of the step time and MFU at the chip's peak.

    mlra train --experiment=mlra4_2p9b --compile_for=v5p-128
"""

from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from mlra_jax.attention import fused
from mlra_jax.config import ConfigError, Experiment, ModelConfig
from mlra_jax.platform import compiling_for
from mlra_jax.tpu_topology import Topology, topology_devices

OUT_OF_MEMORY = ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory")


@dataclasses.dataclass
class CompileReport:
    """What compiling one step for a TPU slice gave (bytes per chip)."""

    step: str  # "train step", "prefill chunk", "decode step"
    topology: str  # the Cloud TPU slice name
    chips: int
    device_kind: str
    mesh: dict[str, int]
    hbm_bytes: int
    compile_s: float
    memory: dict[str, int] | None  # arguments, outputs, aliased, temporaries, generated_code, total
    kernels: dict[str, int]  # Mosaic kernels in the compiled program, by name
    chosen: dict[str, int]  # the attention kernels chosen while tracing (attention.fused)
    flops: float | None  # XLA's cost analysis, per chip (a loop's body counted once)
    bytes_accessed: float | None
    settings: dict[str, Any]  # what the step was built with (micro-batch, remat, batch, context, ...)
    estimate: dict[str, float] = dataclasses.field(default_factory=dict)  # roofline step time and MFU
    error: str | None = None  # the compiler's message when it failed (out of memory: memory is None)

    @property
    def fits(self) -> bool:
        return self.error is None and self.memory is not None and self.memory["total"] <= self.hbm_bytes

    @property
    def margin_bytes(self) -> int | None:
        return None if self.memory is None else self.hbm_bytes - self.memory["total"]

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "fits": self.fits, "margin_bytes": self.margin_bytes}

    def describe(self) -> str:
        """The report as lines for a person."""
        gib = lambda b: f"{b / 2**30:.1f} GiB"
        mesh = ", ".join(f"{k}={v}" for k, v in self.mesh.items())
        settings = ", ".join(f"{k} {v}" for k, v in self.settings.items())
        lines = [
            f"compiled the {self.step} for {self.topology} ({self.chips} x {self.device_kind}, mesh {mesh}) in "
            f"{self.compile_s:.0f} s; {settings}"
        ]
        if self.memory is None:
            lines.append(f"per chip: does NOT fit in {gib(self.hbm_bytes)} of HBM: {self.error}")
        else:
            m = self.memory
            verdict = (
                f"fits, {gib(self.margin_bytes)} to spare"
                if self.fits
                else f"does NOT fit: {gib(-self.margin_bytes)} over"
            )
            lines.append(
                f"per chip: arguments {gib(m['arguments'])}, temporaries {gib(m['temporaries'])}, generated "
                f"code {gib(m['generated_code'])}, outputs not aliased {gib(m['outputs'] - m['aliased'])}: "
                f"{gib(m['total'])} of {gib(self.hbm_bytes)} HBM, {verdict}"
            )
        kernels = ", ".join(f"{name} x{count}" for name, count in sorted(self.kernels.items())) or "none"
        lines.append(f"Mosaic kernels: {kernels}; attention chosen: {self.chosen or 'none'}")
        if self.flops is not None:
            lines.append(
                f"XLA cost analysis per chip (loop bodies once): {self.flops:.3g} FLOPs, "
                f"{self.bytes_accessed:.3g} bytes accessed"
            )
        if self.estimate:
            e = self.estimate
            lines.append(
                f"roofline estimate: {e['step_s']:.3g} s per step ({e['bound']}-bound at the chip's peak)"
                + (f", MFU {e['mfu_no_overlap']:.0%}-{e['mfu']:.0%}" if "mfu" in e else "")
            )
        return "\n".join(lines)


def mosaic_kernels(hlo_text: str) -> dict[str, int]:
    """The Mosaic (Pallas TPU) kernels in a compiled program's text, by the name of the op that called them."""
    kernels: dict[str, int] = {}
    for match in re.finditer(r'custom_call_target="tpu_custom_call"', hlo_text):
        op = re.search(r'op_name="([^"]*)"', hlo_text[match.start() : match.start() + 50_000])
        parts = [p for p in (op.group(1) if op else "").split("/") if p and p != "pallas_call"]
        name = parts[-1] if parts else "unnamed"
        kernels[name] = kernels.get(name, 0) + 1
    return kernels


def _memory(compiled: Any) -> dict[str, int]:
    analysis = compiled.memory_analysis()
    memory = {
        "arguments": analysis.argument_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "aliased": analysis.alias_size_in_bytes,
        "temporaries": analysis.temp_size_in_bytes,
        "generated_code": analysis.generated_code_size_in_bytes,
    }
    memory["total"] = (
        memory["arguments"] + memory["outputs"] - memory["aliased"] + memory["temporaries"] + memory["generated_code"]
    )
    return memory


def _cost(compiled: Any) -> tuple[float | None, float | None]:
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):  # older JAX: one dict per program
        cost = cost[0] if cost else None
    if not cost:
        return None, None
    return cost.get("flops"), cost.get("bytes accessed")


def compile_step(
    step_name: str, topology: Topology, mesh: jax.sharding.Mesh, lower: Callable[[], Any], settings: dict[str, Any]
) -> tuple[CompileReport, Any]:
    """lower() traced and compiled for the TPU under `mesh`: the report and the compiled program (None when the
    compiler gave up for lack of memory). Other compiler errors propagate."""
    start = time.perf_counter()
    compiled, error = None, None
    with compiling_for("tpu"), jax.set_mesh(mesh), fused.kernels_chosen() as chosen:
        lowered = lower()
        try:
            compiled = lowered.compile()
        except Exception as err:  # noqa: BLE001 - XLA raises JaxRuntimeError / XlaRuntimeError
            if not any(marker in str(err) for marker in OUT_OF_MEMORY):
                raise
            error = str(err).strip().splitlines()[0][:500]
    device = mesh.devices.flat[0]
    report = CompileReport(
        step_name,
        topology.slice_name,
        mesh.size,
        device.device_kind,
        {k: int(v) for k, v in mesh.shape.items()},
        topology.chip.hbm_bytes,
        time.perf_counter() - start,
        None,
        {},
        chosen,
        None,
        None,
        settings,
        error=error,
    )
    if compiled is not None:
        report.memory = _memory(compiled)
        report.kernels = mosaic_kernels(compiled.as_text())
        report.flops, report.bytes_accessed = _cost(compiled)
    return report, compiled


def roofline(
    report: CompileReport,
    topology: Topology,
    loop_trips: int = 1,
    kernel_flops_per_chip: float = 0.0,
    model_flops_per_chip: float | None = None,
) -> dict[str, float]:
    """The step time at the chip's peak: the larger of its FLOPs at peak FLOP/s and its bytes at HBM bandwidth.
    FLOPs: the model's count where given, or XLA's (a loop's body times `loop_trips`, plus the FLOPs inside Mosaic
    kernels, which XLA does not count), whichever is larger; bytes: XLA's, times `loop_trips`. XLA counts a nested
    loop's body once, so both undercount, and the MFU (the model's FLOPs over that time at peak) is an upper bound;
    `mfu_no_overlap` adds the memory time to the compute time instead (no overlap)."""
    flops = max((report.flops or 0.0) * loop_trips + kernel_flops_per_chip, model_flops_per_chip or 0.0)
    compute_s = flops / topology.chip.peak_flops
    memory_s = (report.bytes_accessed or 0.0) * loop_trips / topology.chip.hbm_bandwidth
    estimate = {
        "step_s": max(compute_s, memory_s),
        "bound": "compute" if compute_s >= memory_s else "memory",
        "compute_s": compute_s,
        "memory_s": memory_s,
    }
    if model_flops_per_chip is not None:
        estimate["mfu"] = model_flops_per_chip / (estimate["step_s"] * topology.chip.peak_flops)
        # No overlap of compute and memory traffic: the other end of the range
        estimate["mfu_no_overlap"] = model_flops_per_chip / ((compute_s + memory_s) * topology.chip.peak_flops)
    return estimate


def compile_train(experiment: Experiment, topology: Topology) -> CompileReport:
    """The experiment's train step compiled for `topology` (see the module docstring)."""
    from mlra_jax.metrics import attention_flops_per_token, training_flops_per_token
    from mlra_jax.sharding import batch_sharding
    from mlra_jax.training.state import build_setup, jit_train_step

    devices = topology_devices(topology)
    with compiling_for("tpu"):  # remat="auto" traces the layer with the TPU's kernels
        setup = build_setup(experiment, devices)
    train, cfg = setup.experiment.train, setup.experiment.model
    tokens = jax.ShapeDtypeStruct(
        (train.global_batch_size, train.seq_len + 1), jnp.int32, sharding=batch_sharding(setup.mesh)
    )
    state = setup.abstract_state
    micro = train.global_batch_size // train.accumulation_steps
    settings = {
        "global batch": train.global_batch_size,
        "micro-batch": micro,
        "accumulation steps": train.accumulation_steps,
        "remat": cfg.remat,
        "seq_len": train.seq_len,
    }
    report, _ = compile_step(
        "train step",
        topology,
        setup.mesh,
        lambda: jit_train_step(setup).lower(state["params"], state["opt_state"], state["fp8"], tokens),
        settings,
    )
    if report.memory is not None:
        tokens_per_chip = train.global_batch_size * train.seq_len / topology.chips
        in_kernels = attention_flops_per_token(cfg, train.seq_len) * tokens_per_chip if report.kernels else 0.0
        report.estimate = roofline(
            report,
            topology,
            train.accumulation_steps,
            in_kernels,
            training_flops_per_token(cfg, train.seq_len) * tokens_per_chip,
        )
    return report


def not_fitting_advice(report: CompileReport) -> str:
    """What to change when a train step does not fit a chip."""
    s = report.settings
    return (
        f"the train step needs more than the {report.hbm_bytes / 2**30:.1f} GiB of HBM per chip of "
        f"{report.topology} (micro-batch {s['micro-batch']}, remat {s['remat']}): lower "
        f"--train.max_micro_batch_per_device or --train.micro_batch_size, recompute more with --model.remat="
        f"dots or full, shard over more chips (--mesh.fsdp=-1) or compile for a larger slice"
    )


# -- serving ----------------------------------------------------------------------------------------------------
def compile_serving(
    cfg: ModelConfig, topology: Topology, tp: int, batch: int, context: int, prefill_chunk: int = 512
) -> list[CompileReport]:
    """The serving path's prefill chunk and decode step of `cfg` for `topology` at TP degree `tp`, `batch`
    sequences and a cache of `context` slots: reports of both (the prefill at the largest chunk of at most
    `prefill_chunk` tokens that fits), with the cache bytes each chip reads per decode step (`settings`). The
    other chips serve data parallel, as many as the batch splits over (batch 1: the first `tp` chips alone)."""
    from mlra_jax.decode import region_block
    from mlra_jax.decode.serving import ServingModel
    from mlra_jax.kv_cache import SLOT_MULTIPLE, init_layer_caches
    from mlra_jax.model import abstract_model
    from mlra_jax.params import logical_axes
    from mlra_jax.sharding import MESH_AXES, batch_sharding, tree_shardings

    devices = topology_devices(topology)
    if topology.chips % tp:
        raise ConfigError(f"TP={tp} does not divide the {topology.chips} chips of {topology.slice_name}")
    data = max(d for d in range(1, topology.chips // tp + 1) if batch % d == 0)
    mesh = jax.make_mesh(
        (data, 1, tp), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3, devices=devices[: data * tp]
    )
    capacity = -(-context // SLOT_MULTIPLE) * SLOT_MULTIPLE
    abstract = abstract_model(cfg)
    graphdef = nnx.split(abstract)[0]
    params = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    shardings = tree_shardings(params, logical_axes(abstract), mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), params, shardings)
    holder: dict[str, ServingModel] = {}

    def prepare(p: dict[str, Any]) -> dict[str, Any]:
        holder["serving"] = ServingModel(nnx.merge(graphdef, p), mesh, prefill_chunk=prefill_chunk, row_kernels="off")
        return holder["serving"].weights

    with compiling_for("tpu"), jax.set_mesh(mesh):
        prepared = jax.jit(prepare).lower(params).compile()  # the weights' serving shardings, as GSPMD gives them
        weights = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(prepare, params),
            prepared.output_shardings,
        )
        caches = jax.eval_shape(lambda: init_layer_caches(cfg, batch, capacity, None, mesh))
        caches = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), caches, _cache_shardings(caches, mesh, cfg)
        )
    serving = holder["serving"]
    cache_bytes = sum(_per_device_bytes(a) for layer in caches.layers for a in layer.values())
    weight_bytes = sum(_per_device_bytes(a) for a in jax.tree.leaves(weights))
    read_weight_bytes = sum(_per_device_bytes(a) for a in jax.tree.leaves(region_block.decode_read(weights)))
    settings = {
        "tp": tp,
        "batch": batch,
        "context": context,
        "cache per chip (GiB)": round(cache_bytes / 2**30, 3),
        "weights per chip (GiB)": round(weight_bytes / 2**30, 3),
    }

    def compiled(absorbed: bool, tokens_per_call: int) -> CompileReport:
        tokens = jax.ShapeDtypeStruct((batch, tokens_per_call), jnp.int32, sharding=batch_sharding(mesh))
        fn = serving.compiled(absorbed, (batch, tokens_per_call))
        name = "decode step" if absorbed else "prefill chunk"
        lower = lambda: fn.lower(weights, tokens, caches)  # noqa: E731
        return compile_step(name, topology, mesh, lower, {**settings, "tokens per call": tokens_per_call})[0]

    # The prefill chunk: the largest of prefill_chunk, its halves down to 32 tokens, that fits in the cache and in
    # memory (its scores over the whole cache grow with batch x chunk x context); the report of the last one tried
    # when none does.
    for chunk in [c for c in (prefill_chunk, 256, 128, 64, 32) if c <= min(prefill_chunk, capacity)]:
        prefill = compiled(False, chunk)
        if prefill.fits:
            break
    decode = compiled(True, 1)
    if decode.memory is not None:
        read = cache_bytes + read_weight_bytes  # each decode step reads its weights and the whole cache once
        decode.settings["bytes read per step per chip (GiB)"] = round(read / 2**30, 3)
        decode.estimate = roofline(decode, topology)
        decode.estimate["bandwidth_floor_s"] = read / topology.chip.hbm_bandwidth
    return [prefill, decode]


def _cache_shardings(caches: Any, mesh: jax.sharding.Mesh, cfg: ModelConfig) -> Any:
    """The shardings init_layer_caches creates the caches in (eval_shape drops them): layer buffers as planned,
    starts over the data axes, the index replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    from mlra_jax.kv_cache import layer_cache_shardings
    from mlra_jax.sharding import batch_sharding

    layer = layer_cache_shardings(cfg, mesh)
    return dataclasses.replace(
        caches,
        layers=tuple({n: layer[n] for n in buffers} for buffers in caches.layers),
        starts=batch_sharding(mesh, 1),
        index=NamedSharding(mesh, PartitionSpec()),
    )


def _per_device_bytes(a: jax.ShapeDtypeStruct) -> int:
    shard = a.sharding.shard_shape(a.shape)
    size = 1
    for d in shard:
        size *= d
    return size * jnp.dtype(a.dtype).itemsize
