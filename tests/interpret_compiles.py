"""Pallas's kernel interpreter (jax 0.10) compiles each simulated thread's program once per thread per grid point
per call: its thread_map callback wraps the same jaxpr in a new jax.jit and compiles it afresh every time
(callbacks keep it out of the persistent cache), and compiling was 97% of an interpreted MLRA kernel's run on a
CPU. reuse_thread_compiles() keeps one executable per (jaxpr, argument shapes): the same program, run on the same
arguments, so the interpreted kernels compute exactly what they did."""

import threading

import jax


def reuse_thread_compiles() -> bool:
    """Patches the interpreter's thread_map._run_jaxpr (if this jax has it as 0.10 does); True when patched."""
    try:
        from jax._src.pallas.mosaic.interpret import thread_map
    except ImportError:
        return False
    original = getattr(thread_map, "_run_jaxpr", None)
    if original is None or getattr(original, "reuses_compiles", False):
        return original is not None

    compiled, lock = {}, threading.Lock()

    def _run(jaxpr, consts, *args):
        jax.core.eval_jaxpr(jaxpr, consts, *args)

    def _run_jaxpr(jaxpr, consts, *args):
        shapes = tuple(jax.typeof(x) for x in jax.tree.leaves((consts, args)))  # shapes, dtypes, weak types
        key = (id(jaxpr), shapes)
        with lock:  # the first thread compiles; the grid point's other threads wait for it, then share it
            if key not in compiled:
                executable = jax.jit(_run, static_argnums=(0,)).trace(jaxpr, consts, *args).lower().compile()
                compiled[key] = (jaxpr, executable)  # holds the jaxpr, so that its id is not reused
            executable = compiled[key][1]
        executable(consts, *args)

    _run_jaxpr.reuses_compiles = True
    thread_map._run_jaxpr = _run_jaxpr
    return True
