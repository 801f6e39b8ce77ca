"""Triton kernels and their launchers, one op per module (e.g. fusedmoe.kernels.quant).

The modules here import triton at their top, so they are only ever imported lazily, from the
dispatchers that have checked that Triton can run (fusedmoe._triton.triton_runs_on); importing
this package itself imports nothing.
"""
