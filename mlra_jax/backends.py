"""Which backends JAX may start: never the TPU runtime on a machine that has no TPU.

With libtpu installed (the `tpu` and `test` extras), JAX tries to start a TPU backend in every process, and on
a machine without a TPU libtpu prints "Failed to find host bounds for accelerator type ..." and
"E0000 ... unexpected worker hostname ..." before JAX falls back to the CPU. `skip_absent_tpu`, run when
mlra_jax is imported, lists the backends JAX may start without the TPU there: the installed GPU plugins
(CUDA, ROCm; JAX skips CUDA where no NVIDIA GPU is visible) and the CPU. Compiling for a TPU slice
(`--compile_for`) loads libtpu through `jax.experimental.topologies`, which needs no TPU backend.

Nothing changes where the user chose (JAX_PLATFORMS set, or `jax_platforms` configured), where a TPU may be
attached (a TPU chip on the PCI bus, /dev/accel* or /dev/vfio device nodes, TPU_ACCELERATOR_TYPE or
JAX_FORCE_TPU_INIT set), where a JAX plugin of an unknown platform is installed, or once JAX started a backend.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import pkgutil
import sys
from pathlib import Path

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of TPU chips (v3, v4, v5p, v5e, v6e, 7x; as jax._src.hardware_utils lists them); Google's other
# PCI devices (the gVNIC network card of GPU VMs) are no TPU
_TPU_PCI_DEVICES = {"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"}
# JAX plugin modules (jax_plugins.NAME, or an entry point of the jax_plugins group) -> the platform they register
_PLUGIN_PLATFORMS = {"cuda": "cuda", "rocm": "rocm"}


def tpu_may_be_attached() -> bool:
    """Whether this machine may have a TPU: a Google device on the PCI bus, a TPU device node, or the user's
    TPU settings."""
    if any(name in os.environ for name in ("TPU_ACCELERATOR_TYPE", "JAX_FORCE_TPU_INIT")):
        return True
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    for device in glob.glob("/sys/bus/pci/devices/*"):
        try:
            vendor, kind = (Path(device, name).read_text().strip() for name in ("vendor", "device"))
        except OSError:
            continue
        if vendor == _GOOGLE_PCI_VENDOR and kind in _TPU_PCI_DEVICES:
            return True
    return False


def _plugin_names() -> list[str]:
    """The JAX plugins installed: modules of the jax_plugins namespace and entry points of its group."""
    names = [entry.name for entry in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")
    if spec is not None and spec.submodule_search_locations:
        names += [module.name for module in pkgutil.iter_modules(spec.submodule_search_locations)]
    return names


def platforms_without_tpu() -> str | None:
    """The value of jax_platforms that starts every backend JAX would start here but the TPU one ('cuda,cpu',
    'cpu'); None when a plugin of an unknown platform is installed (its platform name is not known here)."""
    platforms = []
    for name in _plugin_names():
        platform = next((p for key, p in _PLUGIN_PLATFORMS.items() if key in name.lower()), None)
        if platform is None:
            return None
        if platform not in platforms:
            platforms.append(platform)
    return ",".join([*platforms, "cpu"])


def skip_absent_tpu() -> str | None:
    """Keep JAX from starting libtpu on a machine with no TPU (see the module's docstring); the platforms set,
    or None when nothing was changed."""
    if "JAX_PLATFORMS" in os.environ or importlib.util.find_spec("libtpu") is None or tpu_may_be_attached():
        return None
    jax = sys.modules.get("jax")
    if jax is not None:  # imported before mlra_jax: change nothing that the user or a backend already settled
        from jax._src import xla_bridge

        if jax.config.jax_platforms or xla_bridge.backends_are_initialized():
            return None
    platforms = platforms_without_tpu()
    if platforms is None:
        return None
    import jax

    jax.config.update("jax_platforms", platforms)
    return platforms


def compile_only() -> None:
    """Start only JAX's CPU backend (unless JAX_PLATFORMS says otherwise): compiling for a TPU slice takes its
    devices from libtpu's topology description and needs no accelerator here."""
    if "JAX_PLATFORMS" not in os.environ:
        import jax

        jax.config.update("jax_platforms", "cpu")
