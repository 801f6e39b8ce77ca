"""The expert kernels (Triton) and their launchers: token alignment, the expert GEMM and the
fused pipelines of the triton, deep_gemm and hpc backends, and their kernel configs. The kernels
of the stages below the experts live with their torch twins: the activation quantizers in
fusedmoe.quant.kernels, the routing kernels in fusedmoe.router.fused.

The modules here import triton at their top, so they are only ever imported lazily, from the
dispatchers that have checked that Triton can run (fusedmoe._triton.triton_runs_on); importing
this package itself imports nothing.
"""
