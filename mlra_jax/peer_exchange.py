"""All-reduces over a mesh axis on the peer kernel (pallas_kernels.peer_all_reduce_gpu) where the axis's groups of
GPUs share a host, else XLA's psum.

`axis_all_reduce(mesh, axis)` returns the function that a shard_map body over every axis of `mesh` calls in place
of `jax.lax.psum(x, axis)`. On NVIDIA GPUs it first sets up, once per process and mesh, each local device's
exchange buffer (the CUDA driver's cuMemAlloc in the device's primary context, the one XLA runs in) and maps the
peers' into this process: devices of this process directly (peer access), those of other processes on the same
host through CUDA IPC handles passed in jax.distributed's key-value store. Every process then publishes whether it
could; unless all could, every process keeps psum, so that the processes' programs agree. The buffers live as long
as the process (compiled programs hold their addresses).

Each device's table (its rank in its group and its group's exchange addresses as its process sees them) enters
the programs as one constant of every device's table, the same in every process, indexed by the device's mesh
coordinates.
"""

from __future__ import annotations

import ctypes
import functools
import os
import socket
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from mlra_jax.pallas_kernels import peer_all_reduce_gpu as kernel

# TP decode steps all-reduce on the peer kernel where the mesh allows it; False keeps XLA's psum (benchmarks'
# --tp_all_reduce=nccl).
PEER_ALL_REDUCE = True
KEY_TIMEOUT_MS = 120_000
_DEBUG = bool(os.environ.get("MLRA_JAX_PEER_DEBUG"))


def _debug(message: str) -> None:
    if _DEBUG:
        print(f"[peer_exchange {jax.process_index()} {time.strftime('%X')}] {message}", file=sys.stderr, flush=True)


_PEER_ACCESS_ALREADY_ENABLED = 704


class DriverError(RuntimeError):
    """A CUDA driver call failed."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


@functools.cache
def _driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    _check(driver, driver.cuInit(0), "cuInit")
    return driver


def _check(driver: ctypes.CDLL, result: int, what: str) -> None:
    if result:
        name = ctypes.c_char_p()
        driver.cuGetErrorName(result, ctypes.byref(name))
        raise DriverError(f"{what} failed: {name.value.decode() if name.value else result}")


@functools.cache
def _context(ordinal: int) -> ctypes.c_void_p:
    """The primary context of CUDA device `ordinal` (XLA's), made current on this thread by _current."""
    driver, device, context = _driver(), ctypes.c_int(), ctypes.c_void_p()
    _check(driver, driver.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
    _check(driver, driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
    return context


def _current(ordinal: int) -> ctypes.CDLL:
    driver = _driver()
    _check(driver, driver.cuCtxSetCurrent(_context(ordinal)), "cuCtxSetCurrent")
    return driver


@functools.cache
def _exchange(ordinal: int) -> int:
    """The exchange buffer of CUDA device `ordinal` (allocated and zeroed once per process)."""
    driver, address = _current(ordinal), ctypes.c_uint64()
    _debug(f"allocating on CUDA device {ordinal}")
    _check(driver, driver.cuMemAlloc_v2(ctypes.byref(address), ctypes.c_size_t(kernel.LAYOUT.size)), "cuMemAlloc")
    _check(driver, driver.cuMemsetD8_v2(address, ctypes.c_ubyte(0), ctypes.c_size_t(kernel.LAYOUT.size)), "cuMemsetD8")
    _check(driver, driver.cuCtxSynchronize(), "cuCtxSynchronize")
    return address.value


def _ipc_handle(ordinal: int) -> bytes:
    driver, handle = _current(ordinal), _IpcHandle()
    address = ctypes.c_uint64(_exchange(ordinal))
    _check(driver, driver.cuIpcGetMemHandle(ctypes.byref(handle), address), "cuIpcGetMemHandle")
    return ctypes.string_at(ctypes.addressof(handle), 64)


@functools.cache
def _opened(ordinal: int, handle: bytes) -> int:
    """A peer process's exchange (its IPC handle) mapped for CUDA device `ordinal` of this process."""
    driver, ipc, address = _current(ordinal), _IpcHandle(), ctypes.c_uint64()
    ctypes.memmove(ctypes.addressof(ipc), handle, 64)
    open_handle = getattr(driver, "cuIpcOpenMemHandle_v2", None) or driver.cuIpcOpenMemHandle
    _check(driver, open_handle(ctypes.byref(address), ipc, ctypes.c_uint(1)), "cuIpcOpenMemHandle")  # lazy peer access
    return address.value


def _enable_peer_access(ordinal: int, peer: int) -> None:
    driver = _current(ordinal)
    result = driver.cuCtxEnablePeerAccess(_context(peer), 0)
    if result != _PEER_ACCESS_ALREADY_ENABLED:
        _check(driver, result, "cuCtxEnablePeerAccess")


def groups(mesh: jax.sharding.Mesh, axis: str) -> list[list[jax.Device]]:
    """The mesh's devices in groups along `axis` (one group per coordinate of the other axes), each in axis order."""
    devices = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
    return [list(group) for group in devices.reshape(-1, devices.shape[-1])]


def _kv_client():
    from jax._src.distributed import global_state

    return global_state.client


def _gathered(mesh: jax.sharding.Mesh, key: str, value_of: Callable[[jax.Device], str]) -> dict[int, str]:
    """Every mesh device's value_of(device) through jax.distributed's key-value store: each process publishes its
    own devices' values, then waits for every device's."""
    client = _kv_client()
    for device in mesh.devices.flat:
        if device.process_index == jax.process_index():
            _debug(f"publishing {key}/{device.id}")
            client.key_value_set(f"{key}/{device.id}", value_of(device))
    _debug(f"waiting for {key}")
    return {d.id: client.blocking_key_value_get(f"{key}/{d.id}", KEY_TIMEOUT_MS) for d in mesh.devices.flat}


def _shared_handles(mesh: jax.sharding.Mesh, key: str) -> dict[int, tuple[str, bytes]]:
    """Every mesh device's (host, IPC handle of its exchange), published by the process that owns it."""
    published = _gathered(mesh, key, lambda d: f"{socket.gethostname()} {_ipc_handle(d.local_hardware_id).hex()}")
    return {i: (value.split()[0], bytes.fromhex(value.split()[1])) for i, value in published.items()}


def _local_rows(mesh: jax.sharding.Mesh, axis: str, shared: dict[int, tuple[str, bytes]]) -> np.ndarray:
    """uint32 [*mesh.shape, 2 (size + 2)]: this process's devices' kernel.table_row (its rank along `axis`, its
    group's exchanges as this process sees them; the peers of other processes from their IPC handles in `shared`),
    zeros for the other processes' devices."""
    me, size = jax.process_index(), mesh.shape[axis]
    hosts = {host for host, _ in shared.values()}
    if len(hosts) > 1 and any(len({shared[d.id][0] for d in g}) > 1 for g in groups(mesh, axis)):
        raise DriverError(f"a group of `{axis}` spans hosts ({sorted(hosts)})")
    table = np.zeros((*mesh.devices.shape, 2 * (size + 2)), np.uint32)
    coordinates = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
    for group in groups(mesh, axis):
        for rank, device in enumerate(group):
            if device.process_index != me:
                continue
            ordinal, addresses = device.local_hardware_id, []
            for peer in group:
                if peer.process_index == me:
                    if peer.id != device.id:
                        _enable_peer_access(ordinal, peer.local_hardware_id)
                    addresses.append(_exchange(peer.local_hardware_id))
                else:
                    addresses.append(_opened(ordinal, shared[peer.id][1]))
            table[coordinates[device.id]] = kernel.table_row(rank, addresses)
    return table


def _every_row(mesh: jax.sharding.Mesh, local: np.ndarray, key: str) -> np.ndarray:
    """The tables of every device: each process publishes its devices' rows and reads the others', so that every
    process holds the same tables and compiles the same programs, as XLA requires of them (its autotuning shared
    between processes is keyed by the program)."""
    if jax.process_count() == 1:
        return local
    coordinates = {d.id: c for c, d in np.ndenumerate(mesh.devices)}
    rows = _gathered(mesh, f"{key}/row", lambda d: local[coordinates[d.id]].tobytes().hex())
    table = local.copy()
    for device_id, row in rows.items():
        table[coordinates[device_id]] = np.frombuffer(bytes.fromhex(row), np.uint32)
    return table


def _agreed(ok: bool, key: str) -> bool:
    """Whether every process could set up its exchanges (each publishes its own outcome)."""
    if jax.process_count() == 1:
        return ok
    client = _kv_client()
    _debug(f"agreeing: {ok}")
    client.key_value_set(f"{key}/ok/{jax.process_index()}", "1" if ok else "0")
    outcomes = [client.blocking_key_value_get(f"{key}/ok/{p}", KEY_TIMEOUT_MS) for p in range(jax.process_count())]
    return all(outcome == "1" for outcome in outcomes)


_tables: dict[tuple, np.ndarray | None] = {}


def hopper_or_later(device: jax.Device) -> bool:
    """Whether `device` is an NVIDIA GPU of compute capability 9.0 or more (the kernel's PTX targets sm_90) whose
    jaxlib launches the kernel."""
    if device.platform != "gpu" or not device.device_kind.startswith("NVIDIA"):
        return False
    try:
        capability = float(getattr(device, "compute_capability", "0"))
    except ValueError:
        return False
    return capability >= 9.0 and kernel.available()


def peer_tables(mesh: jax.sharding.Mesh, axis: str) -> np.ndarray | None:
    """The mesh's tables for the peer kernel over `axis`, or None where its groups cannot run it (not NVIDIA GPUs,
    a group across hosts, a driver call that failed in any process)."""
    key = (tuple(d.id for d in mesh.devices.flat), mesh.devices.shape, axis)
    if key in _tables:
        return _tables[key]
    if not all(hopper_or_later(d) for d in mesh.devices.flat) or not 2 <= mesh.shape[axis] <= kernel.MAX_RANKS:
        _tables[key] = None
        return None
    name = f"mlra_jax/peer_exchange/{axis}/" + "-".join(str(i) for i in key[0])
    try:
        _debug(f"setting up {name}")
        shared = _shared_handles(mesh, name) if jax.process_count() > 1 else {}
        local, ok = _local_rows(mesh, axis, shared), True
    except Exception as error:  # noqa: BLE001 (any failure, here or a peer's timeout: every process keeps psum)
        print(f"mlra_jax: all-reduces over `{axis}` stay on XLA's psum: {error}", file=sys.stderr)
        local, ok = None, False
    _tables[key] = _every_row(mesh, local, name) if _agreed(ok, name) else None
    _debug(f"tables {'ready' if _tables[key] is not None else 'not used'}")
    return _tables[key]


def axis_all_reduce(mesh: jax.sharding.Mesh, axis: str) -> Callable[[jax.Array], jax.Array]:
    """The sum over `axis` as a shard_map body over every axis of `mesh` computes it: the peer kernel for arrays it
    takes (kernel.fits) where the mesh allows it (peer_tables, PEER_ALL_REDUCE), else jax.lax.psum."""
    tables = peer_tables(mesh, axis) if PEER_ALL_REDUCE else None

    def reduce(x: jax.Array) -> jax.Array:
        if tables is None or not kernel.fits(x.shape, x.dtype, mesh.shape[axis]):
            return jax.lax.psum(x, axis)
        row = jnp.asarray(tables)[tuple(jax.lax.axis_index(name) for name in mesh.axis_names)]
        return kernel.peer_all_reduce(x, row)

    return reduce
