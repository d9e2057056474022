"""TPU slices by name, and their devices for compiling ahead of time on a machine without TPUs.

A slice is named as Cloud TPU names it (`v5p-128`, `v5e-256`, `v6e-64`, `v4-32`; v4 and v5p count
TensorCores, two per chip, v5e and v6e count chips) or by its chip grid (`v5p:4x4x4`, `v5e:16x16`).
`topology_devices` asks libtpu (`pip install 'jax[tpu]'`) for the slice's devices through
`jax.experimental.topologies`: compile-only devices, one per chip, that `jit(...).lower(...).compile()` targets
with the real TPU compiler, Mosaic kernels included, while this process keeps its own backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
from typing import Iterator

import jax

from mlra_jax.backends import tpu_may_be_attached
from mlra_jax.config import ConfigError


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation: per-chip HBM, dense bf16 peak and HBM bandwidth (Cloud TPU datasheets)."""

    generation: str  # as in slice names: v4, v5p, v5e, v6e
    device_kind: str  # jax's device_kind of its devices
    hbm_bytes: int
    peak_flops: float
    hbm_bandwidth: float  # bytes/s
    cores_in_name: bool  # slice names count TensorCores (two per chip), not chips
    grid_dims: int  # 3 (a torus of chips) or 2
    chip_config: str  # libtpu's chip configuration: megacore (one device per chip) or default


CHIPS = {
    chip.generation: chip
    for chip in (
        Chip("v4", "TPU v4", 32 * 2**30, 275e12, 1.2e12, True, 3, "megacore"),
        Chip("v5p", "TPU v5", 95 * 10**9, 459e12, 2.765e12, True, 3, "megacore"),
        Chip("v5e", "TPU v5 lite", 16 * 10**9, 197e12, 0.819e12, False, 2, "default"),
        Chip("v6e", "TPU v6 lite", 32 * 10**9, 918e12, 1.64e12, False, 2, "default"),
    )
}
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6": "v6e", "v5": "v5p"}
# Chip grids of the slice sizes Cloud TPU offers (chips -> grid)
_GRIDS_3D = {
    4: (2, 2, 1),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
    128: (4, 4, 8),
    256: (4, 8, 8),
    512: (8, 8, 8),
    1024: (8, 8, 16),
    2048: (8, 16, 16),
    4096: (16, 16, 16),
}
_GRIDS_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


@dataclasses.dataclass(frozen=True)
class Topology:
    """A TPU slice: its chip generation and chip grid."""

    chip: Chip
    grid: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.grid)

    @property
    def name(self) -> str:
        """The libtpu topology name, e.g. v5p:4x4x4."""
        return f"{self.chip.generation}:{'x'.join(map(str, self.grid))}"

    @property
    def slice_name(self) -> str:
        """The Cloud TPU name, e.g. v5p-128."""
        return f"{self.chip.generation}-{self.chips * (2 if self.chip.cores_in_name else 1)}"


def parse_topology(text: str) -> Topology:
    """`v5p-128`, `v5e-256`, `v4-32`, `v6e-64` or `v5p:4x4x4` -> Topology; a ConfigError that lists the names
    otherwise."""
    known = ", ".join(sorted(CHIPS))
    example = "v5p-128 (64 chips), v5e-256, v6e-64, v4-32, or a chip grid such as v5p:4x4x4 or v5e:16x16"
    grid_form = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+)*)", text.strip().lower())
    count_form = re.fullmatch(r"([a-z0-9]+)-(\d+)", text.strip().lower())
    if not (grid_form or count_form):
        raise ConfigError(f"--compile_for={text!r} is not a TPU slice name; use {example}")
    generation = (grid_form or count_form).group(1)
    chip = CHIPS.get(_ALIASES.get(generation, generation))
    if chip is None:
        raise ConfigError(f"--compile_for={text!r}: unknown TPU generation {generation!r}; known: {known}")
    if grid_form:
        grid = tuple(int(d) for d in grid_form.group(2).split("x"))
        if len(grid) != chip.grid_dims or min(grid) < 1:
            raise ConfigError(
                f"--compile_for={text!r}: a {chip.generation} chip grid has {chip.grid_dims} positive "
                f"dimensions (e.g. {chip.generation}:{'x'.join(['2'] * chip.grid_dims)})"
            )
        return Topology(chip, grid)
    count = int(count_form.group(2))
    grids = _GRIDS_3D if chip.grid_dims == 3 else _GRIDS_2D
    chips = count // 2 if chip.cores_in_name else count
    if (chip.cores_in_name and count % 2) or chips not in grids:
        unit = "TensorCores (two per chip)" if chip.cores_in_name else "chips"
        sizes = ", ".join(f"{chip.generation}-{c * (2 if chip.cores_in_name else 1)}" for c in grids)
        raise ConfigError(f"--compile_for={text!r}: {chip.generation} slices count {unit}; the sizes are {sizes}")
    return Topology(chip, grids[chips])


def chip_for_device(device: jax.Device) -> Chip | None:
    """The Chip of a TPU device (real or compile-only), or None for other devices."""
    kind = getattr(device, "device_kind", "")
    return next((chip for chip in CHIPS.values() if chip.device_kind == kind), None)


def topology_devices(topology: Topology) -> list[jax.Device]:
    """The slice's compile-only devices (one per chip) from libtpu; a ConfigError naming the fix when libtpu is
    missing or refuses the topology."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no GCE metadata lookups on a machine that is not a TPU VM
    # compile-only use takes no TPU: let several processes load libtpu (its lockfile guards a real TPU's owner)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        with _quiet_libtpu(topology):
            description = topologies.get_topology_desc(
                platform="tpu",
                topology_name=topology.name,
                chip_config_name=topology.chip.chip_config,
                chips_per_host_bounds=(2, 2, 1),
                num_slices=1,
                # v4 and v5p slices are tori; a v5e or v6e grid wraps only along a full 16-chip side, which libtpu
                # knows by itself (it refuses wrap-around along a shorter one)
                **({"wrap": (True, True, True)} if topology.chip.grid_dims == 3 else {}),
            )
    except Exception as err:  # noqa: BLE001 - libtpu's errors are RuntimeErrors of several kinds
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        if not _libtpu_installed():
            raise ConfigError(
                f"compiling for {topology.slice_name} needs libtpu, which is not installed here: "
                f"pip install 'jax[tpu]' (or the project's tpu extra: pip install -e '.[tpu]')"
            ) from None
        raise ConfigError(
            f"libtpu cannot describe the TPU topology {topology.name} ({message}); check the slice "
            f"name, or update libtpu with pip install -U 'jax[tpu]'"
        ) from None
    devices = list(description.devices)
    if len(devices) != topology.chips:
        raise ConfigError(
            f"libtpu described {len(devices)} devices for {topology.name}, not one per chip ({topology.chips})"
        )
    return devices


@contextlib.contextmanager
def _quiet_libtpu(topology: Topology) -> Iterator[None]:
    """On a machine without a TPU, libtpu (loaded by the first topology asked for) looks for the TPU VM's
    accelerator type and worker hostnames and prints errors when it finds none: name the slice compiled for and
    this host, while it loads only (child processes never see them)."""
    names = {"TPU_ACCELERATOR_TYPE": topology.slice_name, "TPU_WORKER_HOSTNAMES": "localhost"}
    added = {} if tpu_may_be_attached() else {k: v for k, v in names.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _libtpu_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("libtpu") is not None
