"""The peer all-reduce (pallas_kernels.peer_all_reduce_gpu, mlra_jax.peer_exchange): its arithmetic, its limits, its
PTX, each device's table and the processes' agreement on any machine (the CUDA driver faked); on NVIDIA GPUs the
kernel against its reference on every device, and tensor-parallel serving on it against NCCL's logits."""

import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_gpu, sharded_over
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from mlra_jax.experiments.tiny import tiny_model
from mlra_jax.pallas_kernels import peer_all_reduce_gpu as kernel

from mlra_jax import peer_exchange
from mlra_jax.benchmarks.decode_throughput import free_port
from mlra_jax.config import MeshConfig
from mlra_jax.decode.generator import Generator, left_pad
from mlra_jax.model import init_model
from mlra_jax.sharding import make_mesh


def _partials(ranks: int, shape: tuple[int, ...], seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (ranks, *shape), jnp.float32).astype(jnp.bfloat16)


def test_the_reference_is_the_float32_sum_in_rank_order_rounded_once():
    two = _partials(2, (64, 48))
    np.testing.assert_array_equal(kernel.reference(two), two[0] + two[1])  # one bf16 addition rounds once too
    four = _partials(4, (64, 48), seed=1)
    want = four.astype(jnp.float32).sum(axis=0).astype(jnp.bfloat16)
    np.testing.assert_array_equal(kernel.reference(four), want)
    chained = ((four[0] + four[1]) + four[2]) + four[3]  # bf16 at each step: rounds three times
    assert not np.array_equal(np.asarray(chained), np.asarray(want))


def test_what_one_call_takes():
    assert kernel.fits((64, 3072), jnp.bfloat16, 4)
    assert kernel.fits((341, 1, 3072), jnp.bfloat16, 2)  # 2,095,104 bytes: under the slot's 2 MiB
    assert not kernel.fits((342, 1, 3072), jnp.bfloat16, 2)
    assert not kernel.fits((64, 3072), jnp.float32, 4)
    assert not kernel.fits((3, 5), jnp.bfloat16, 4)  # not in vectors of 8
    assert not kernel.fits((64, 3072), jnp.bfloat16, 1)
    assert not kernel.fits((64, 3072), jnp.bfloat16, kernel.MAX_RANKS + 1)
    assert kernel.ctas_for(64 * 3072) == 24 and kernel.ctas_for(3072) == 1
    assert kernel.ctas_for(kernel.SLOT_BYTES // 2) == kernel.MAX_CTAS
    words = kernel.table_row(1, [2**40 + 7, 2**33])
    assert words.dtype == np.uint32 and words.view(np.uint64).tolist() == [1, 2, 2**40 + 7, 2**33]
    flags, counters = 2 * kernel.MAX_RANKS * kernel.MAX_CTAS * 4, kernel.MAX_CTAS * 4
    assert kernel.LAYOUT.size == 2 * kernel.SLOT_BYTES + flags + counters


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_the_ptx_reads_every_member_and_signals_every_peer(ranks):
    ptx = kernel.ptx_source("k", 24576, ranks)
    assert f".maxntid {kernel.THREADS}, 1, 1" in ptx
    assert len(re.findall(r"ld\.global\.cg\.v4\.u32", ptx)) == ranks * kernel.VECTORS_PER_THREAD
    assert len(re.findall(r"add\.rn\.f32", ptx)) == 8 * (ranks - 1) * kernel.VECTORS_PER_THREAD
    assert ptx.count("st.release.sys.global.u32") == 1 and ptx.count("ld.acquire.sys.global.u32") == 1
    assert f"setp.ge.u32 %p3, %r1, {ranks};" in ptx  # the threads that signal and wait: one per member
    assert "trap;" in ptx and ptx.count("ret;") == 1


def test_off_nvidia_gpus_the_axis_sum_is_psum():
    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    assert peer_exchange.peer_tables(mesh, "tensor") is None
    reduce = peer_exchange.axis_all_reduce(mesh, "tensor")
    x = jax.device_put(_partials(4, (8, 16))[:, None], NamedSharding(mesh, P(("data", "tensor"))))
    summed = jax.jit(jax.shard_map(reduce, mesh=mesh, in_specs=P(("data", "tensor")), out_specs=P(("data", "tensor"))))
    got = np.asarray(summed(x)).astype(np.float32)
    parts = np.asarray(x).astype(np.float32)
    np.testing.assert_allclose(got[0], parts[0] + parts[1], rtol=1e-2)
    np.testing.assert_allclose(got[3], parts[2] + parts[3], rtol=1e-2)


def test_groups_follow_the_axis():
    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    ids = [[d.id for d in g] for g in peer_exchange.groups(mesh, "tensor")]
    grid = [[d.id for d in row] for row in mesh.devices.reshape(2, 2)]
    assert ids == grid  # tensor is the last axis: each row is a group
    assert [[d.id for d in g] for g in peer_exchange.groups(mesh, "data")] == [list(c) for c in zip(*grid)]


def _two_or_more_gpus(test):
    return on_gpu(pytest.mark.skipif(jax.device_count() < 2, reason="needs 2 GPUs")(test))


@_two_or_more_gpus
def test_the_kernel_gives_every_device_the_reference_sum_call_after_call():
    ranks = jax.device_count()
    mesh = make_mesh(MeshConfig(data=1, tensor=ranks), jax.devices())
    tables = peer_exchange.peer_tables(mesh, "tensor")
    assert tables is not None
    reduce = peer_exchange.axis_all_reduce(mesh, "tensor")
    spec = P("tensor")

    def calls(big, small):  # the two shapes alternate: calls of 24 CTAs and of one share the counters
        def one(_, xs):
            b, s = xs
            return reduce(b * jnp.bfloat16(0.5)), reduce(s * jnp.bfloat16(0.5))

        return jax.lax.fori_loop(0, 20, one, (big, small)), (reduce(big), reduce(small))

    out_specs = ((spec, spec), (spec, spec))
    mapped = jax.jit(jax.shard_map(calls, mesh=mesh, in_specs=(spec, spec), out_specs=out_specs, check_vma=False))
    big, small = _partials(ranks, (64, 3072), 2), _partials(ranks, (1, 3072), 3)
    sharding = NamedSharding(mesh, spec)
    (big_20, small_20), (big_1, small_1) = mapped(
        jax.device_put(big.reshape(-1, 3072), sharding), jax.device_put(small.reshape(-1, 3072), sharding)
    )
    np.testing.assert_array_equal(np.asarray(big_1).reshape(ranks, 64, 3072)[0], kernel.reference(big))
    np.testing.assert_array_equal(np.asarray(small_1).reshape(ranks, 1, 3072)[0], kernel.reference(small))
    for out in (big_1, small_1, big_20, small_20):
        blocks = np.asarray(out).reshape(ranks, -1)
        assert all(np.array_equal(blocks[0], blocks[i]) for i in range(ranks))  # the same sum on every device
        assert np.isfinite(blocks.astype(np.float32)).all()
    hlo = mapped.lower(big.reshape(-1, 3072), small.reshape(-1, 3072)).compile().as_text()
    assert "triton_kernel_call_ffi" in hlo and "all-reduce" not in hlo


@_two_or_more_gpus
def test_tensor_parallel_serving_on_the_peer_kernel_gives_nccls_logits(monkeypatch):
    cfg = tiny_model("mlra4", n_layer=2, n_head=8, vocab_size=64, output_init="normal", compute_dtype="bfloat16")
    mesh = make_mesh(MeshConfig(data=1, tensor=2), jax.devices()[:2])
    model = sharded_over(init_model(cfg, seed=0), mesh)
    tokens, starts = left_pad([[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]])
    logits, hlo = {}, {}
    for peer in (True, False):
        monkeypatch.setattr(peer_exchange, "PEER_ALL_REDUCE", peer)
        serving = Generator(model, max_len=16, mesh=mesh).serving
        _, session = serving.prefill(tokens, starts, 1, 16)
        with jax.set_mesh(mesh):
            step = serving.compiled(True, (4, 1))
            hlo[peer] = step.lower(serving.weights, jnp.arange(4)[:, None], session.caches).compile().as_text()
        logits[peer] = np.asarray(serving.step(jnp.arange(4)[:, None], session))
    assert hlo[True].count("triton_kernel_call_ffi") >= 2 * 2 and "triton_kernel_call_ffi" not in hlo[False]
    np.testing.assert_array_equal(logits[True], logits[False])  # two partials: one rounding either way


def test_each_devices_table_names_its_rank_and_its_groups_exchanges_in_axis_order(monkeypatch):
    """peer_exchange's tables on a (data 2, tensor 2) mesh, with the CUDA driver's calls replaced by fakes (the
    exchange of CUDA device n at 1000 n + 16): each device's row is its rank along `tensor`, the group's size and
    the addresses of its group's exchanges, in the axis's order; peer access is enabled within each group only."""
    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    enabled = []
    monkeypatch.setattr(peer_exchange, "_exchange", lambda ordinal: 1000 * ordinal + 16)
    monkeypatch.setattr(peer_exchange, "_enable_peer_access", lambda ordinal, peer: enabled.append((ordinal, peer)))
    tables = peer_exchange._local_rows(mesh, "tensor", {})
    assert tables.shape == (*mesh.devices.shape, 2 * (2 + 2)) and tables.dtype == np.uint32
    along = mesh.axis_names.index("tensor")
    rows = np.moveaxis(mesh.devices, along, -1).reshape(-1, 2)  # the groups, each in `tensor` order
    for coordinates, device in np.ndenumerate(mesh.devices):
        group = next(row for row in rows if device in row)
        addresses = [1000 * d.local_hardware_id + 16 for d in group]
        assert tables[coordinates].view(np.uint64).tolist() == [coordinates[along], 2, *addresses]
    want = {(a.local_hardware_id, b.local_hardware_id) for row in rows for a in row for b in row if a != b}
    assert sorted(enabled) == sorted(want)


_PROCESS = """
import json, sys
import jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
rank, coordinator, failing = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
jax.distributed.initialize(coordinator, num_processes=2, process_id=rank)
from mlra_jax import peer_exchange as px
px.KEY_TIMEOUT_MS = 60_000
px.hopper_or_later = lambda device: True
px._enable_peer_access = lambda ordinal, peer: None
px._exchange = lambda ordinal: 1000 * (10 * rank + ordinal) + 16
px._ipc_handle = lambda ordinal: bytes([rank, ordinal]) + bytes(62)
def opened(ordinal, handle):
    if rank == failing:
        raise px.DriverError("no peer access")
    return 500_000 + 1000 * (10 * rank + ordinal) + 10 * handle[0] + handle[1]
px._opened = opened
devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))  # [p0 d0, p0 d1, p1 d0, p1 d1]
mesh = jax.sharding.Mesh(np.array(devices)[[0, 2, 1, 3]].reshape(2, 2), ("data", "tensor"))
tables = px.peer_tables(mesh, "tensor")
print(json.dumps(None if tables is None else tables.view(np.uint64).tolist()), flush=True)
jax.distributed.shutdown()
"""


@pytest.mark.parametrize("failing", [-1, 1])
def test_processes_build_the_same_tables_or_all_keep_psum(failing):
    """Two CPU processes of two devices each, `tensor` groups across the processes, the CUDA driver's calls faked:
    both processes hold every device's row, each as its owner sees its group (its own exchange, the peer's IPC
    mapping), so that they compile the same programs; where one process cannot open its peer's handle, both keep
    psum."""
    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2")
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _PROCESS, str(rank), coordinator, str(failing)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [child.communicate(timeout=120) for child in children]
    assert all(child.returncode == 0 for child in children), [err[-2000:] for _, err in outputs]
    tables = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    if failing >= 0:
        assert tables == [None, None]
        assert "stay on XLA's psum: no peer access" in outputs[failing][1]
        return
    assert tables[0] == tables[1]
    # mesh [[p0 d0, p1 d0], [p0 d1, p1 d1]]: group i holds device i of each process, ranks by process
    for i in range(2):
        for rank in range(2):
            own = 1000 * (10 * rank + i) + 16
            peer = 500_000 + 1000 * (10 * rank + i) + 10 * (1 - rank) + i
            want = [own, peer] if rank == 0 else [peer, own]
            assert tables[0][i][rank] == [rank, 2, *want]
