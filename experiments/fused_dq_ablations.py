"""Ablations of the fused-dQ backward kernel (text edits of its module), each timed by the profiler beside the split
backward, on MLRA-4 2.9B's layer (batch 8, T 2048, 4 blocks of 24 heads, R 128, Dr 64)."""
import importlib.util, json, sys, os
import jax, jax.numpy as jnp
import mlra_jax.pallas_kernels.mlra_attention_gpu_backward as bwd
import mlra_jax.pallas_kernels.mlra_attention_gpu_fused_dq as fused
from mlra_jax.pallas_kernels.mlra_attention_gpu import mlra_attention_gpu
from mlra_jax.benchmarks.common import profiled_time

src = open(fused.__file__).read()
EDITS = {
    "fused": [],
    "noreduce": [("        plgpu.copy_smem_to_gmem(staged, accumulator, reduction_op=\"add\")", "        pass")],
}
variants = {}
for name, edits in EDITS.items():
    text = src
    for a, b in edits:
        assert a in text, (name, a)
        text = text.replace(a, b)
    path = f"/tmp/fused_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"fused_{name}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
    variants[name] = mod.dkv_dq

b, t, n, h, r, dr = 8, 2048, 4, 24, 128, 64
k = jax.random.split(jax.random.key(0), 5)
bf = jnp.bfloat16
x = (jax.random.normal(k[0], (h, b, t, n, r), bf), jax.random.normal(k[1], (b, t, h, dr), bf),
     jax.random.normal(k[2], (b, t, n, r), bf), jax.random.normal(k[3], (b, t, dr), bf))
scale = 192 ** -0.5
out, lse = mlra_attention_gpu(*x, scale=scale)
do = jax.random.normal(k[4], out.shape, bf)
rows = {}
def timed(label, tuning):
    jax.clear_caches()
    f = jax.jit(lambda *a: bwd.mlra_attention_backward.__wrapped__(*a, scale=scale, tuning=tuning))
    res = profiled_time(lambda: f(*x, out, lse, do), 10)
    kern = {kk: round(v * 1e3, 3) for kk, v in res.get("kernels_s", res.get("kernels", {})).items()} if isinstance(res.get("kernels_s", res.get("kernels")), dict) else None
    rows[label] = dict(span_ms=round(res["time_s"] * 1e3, 3), kernels_ms=kern)
    print(label, rows[label], flush=True)
timed("split", bwd.BackwardTuning())
orig = bwd.dkv_dq
for name, fn in variants.items():
    bwd.dkv_dq = fn
    for splits in (1, 2, 6, 24):
        try:
            timed(f"{name}_splits{splits}", bwd.BackwardTuning(fused_dq=True, head_splits=splits))
        except Exception as e:
            print(name, splits, "failed", repr(e)[:400])
bwd.dkv_dq = orig
json.dump(rows, open(os.environ.get("OUT", "/tmp") + "/ablate_fused.json", "w"), indent=1)
