"""XLA flags of the test runs, in-process and in subprocesses (imports nothing, so that conftest can set them
before JAX loads). The suite is compile-bound on CPUs; none of these changes what a test checks."""

# Both: LLVM compiles each program as one module, not split for parallel codegen (on the 2 busy cores of a CI machine
# the split only adds work: 12% less CPU for test_training.py and test_golden.py, 9% for two subprocess-heavy files).
ONE_CODEGEN_MODULE = "--xla_cpu_parallel_codegen_split_count=1"
# In-process: the cheapest CPU compile (XLA's new fusion emitters cost twice the compile time at level 0).
IN_PROCESS = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false "
    + ONE_CODEGEN_MODULE
)
# Training subprocesses run tens of steps: level 1 compiles nearly as fast and its steps run as fast as level 2's.
SUBPROCESS = "--xla_backend_optimization_level=1 --xla_cpu_use_fusion_emitters=false " + ONE_CODEGEN_MODULE
