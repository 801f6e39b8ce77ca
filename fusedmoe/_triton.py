"""Triton at run time: whether its kernels can run (triton is imported lazily, never at package
import), and launching them with little host work.

Launching (`launch`): `JITFunction.run` does, on every launch: bind the arguments and compute
their specialization, hash that into a cache key, compare every global the kernel read with its
value at compile time (one `tl.constexpr` comparison each: our GEMM kernel reads about twenty),
build launch metadata for profiling hooks, then launch. On the lent GPUs' host a plain launch of
our GEMM kernel costs several times a torch op; an eager decode call launches three to five
kernels.

`launch` keeps the parts that decide *which* binary runs (Triton's own binder and cache key,
so the specialization on dtypes, 16-byte alignment and integer values is exactly Triton's) and
skips the rest once a kernel has been launched through Triton's normal path on that device:

    first launch on a device   kernel[grid](*args, **constexprs)   (compiles; learns the options
                                                                     run() adds to the binder)
    later launches             binder -> cache key -> the compiled kernel -> its launcher

Anything unusual falls back to the normal path: the interpreter (CPU tensors), a key Triton has
not compiled yet, a Triton whose internals differ from what this module expects (the fast path
turns itself off for the process after three failed lookups in a row), or Triton's debug or
instrumentation knobs changed since the kernel was learned (it is learned again). Launch hooks
(profilers) are passed through with their metadata, as run() does. The global values check is
dropped on purpose: fusedmoe's kernels read only module constants.

`op_or_impl`: a torch.library custom op while torch.compile traces, its implementation
otherwise (the dispatcher's round trip costs tens of microseconds on a slow host).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os

import torch

INSTALL_HINT = "pip install triton, or the extra: pip install 'fusedmoe[gpu]'"


# Found once, without importing triton; a plain global, so torch.compile reads it as a constant
# (it refuses to trace importlib).
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def has_triton() -> bool:
    return _HAS_TRITON


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(t: torch.Tensor) -> bool:
    """Whether a Triton kernel can take this tensor: CUDA, or the CPU under the interpreter."""
    return has_triton() and (t.is_cuda or (t.device.type == "cpu" and interpreting()))


# ---- host arithmetic of launches ----
# Newer Triton makes triton.cdiv and triton.next_power_of_2 constexpr functions: callable from
# host code, but through a wrapper that costs microseconds a call, and a call path computes
# several. These are the same integers.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b), as triton.cdiv."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as triton.next_power_of_2."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU (a kernel goes to the current device, not its tensors'); nothing on
    the CPU."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# ---- launching ----

_STATS: dict[str, object] = {"fast": 0, "slow": 0}
# (kernel, device index) -> (binder, kernel_cache, key_cache, extra binder kwargs, knob state)
_LEARNED: dict[tuple[object, int], tuple] = {}
_ENABLED = True
_FAILURES = 0  # fast-path lookups that raised in a row


def launch_stats() -> dict[str, object]:
    """Launches through the fast path and through `kernel[grid]` so far, and why the fast path
    turned itself off if it did (for benchmarks and tests)."""
    return dict(_STATS)


def launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict, on_cuda: bool) -> None:
    """kernel[grid](*args, **constexprs), with JITFunction.run's per-launch work cut (above).

    args: the runtime arguments in the kernel's order; constexprs: every tl.constexpr argument
    and launch option (num_warps, num_stages) by keyword; on_cuda: the tensors are on a CUDA
    device (False: the interpreter, always the normal path).
    """
    global _ENABLED, _FAILURES
    if not (on_cuda and _ENABLED):
        kernel[grid](*args, **constexprs)
        return
    try:
        from triton import knobs
        from triton.runtime.jit import compute_cache_key
    except ImportError:  # an older Triton: the normal path for good
        _ENABLED = False
        kernel[grid](*args, **constexprs)
        return
    device = torch.cuda.current_device()
    learned = _LEARNED.get((kernel, device))
    knob_state = _knob_state(knobs)
    if learned is None or learned[4] != knob_state:
        # first launch, or Triton's debug / instrumentation knobs changed since: learn again
        _learn(kernel, device, grid, args, constexprs, knob_state)
        return
    try:
        binder, kernel_cache, key_cache, extra, _ = learned
        bound, specialization, options = binder(*args, **constexprs, **extra)
        compiled = kernel_cache.get(compute_cache_key(key_cache, specialization, options))
    except (AttributeError, TypeError, ValueError) as exc:
        compiled = None
        _FAILURES += 1
        if _FAILURES >= 3:  # Triton's internals are not what this module knows: off for good
            _ENABLED = False
            _STATS["disabled"] = f"{type(exc).__name__}: {exc}"[:200]
    if compiled is None or getattr(compiled, "function", None) is None:
        _STATS["slow"] += 1
        kernel[grid](*args, **constexprs)  # not compiled for this specialization, or unknown
        return
    _FAILURES = 0
    values = bound.values()
    grid_x = grid[0]
    grid_y = grid[1] if len(grid) > 1 else 1
    grid_z = grid[2] if len(grid) > 2 else 1
    stream = _raw_stream(device)
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    metadata = None  # what profiling hooks read: built only when one listens
    if enter is not None or leave is not None:
        metadata = compiled.launch_metadata(grid, stream, *values)
    # The launcher parses every argument before it launches: a mismatch raises here, and is
    # not retried (a hook that raised after the launch must not launch the kernel twice).
    compiled.run(
        grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
        metadata, enter, leave, *values,
    )  # fmt: skip
    _STATS["fast"] += 1


def _knob_state(knobs) -> tuple:
    """The process-wide Triton settings (triton.knobs) that change which binary run() picks or
    builds."""
    runtime, compilation = knobs.runtime, knobs.compilation
    return (
        getattr(runtime, "debug", None),
        getattr(compilation, "instrumentation_mode", None),
        getattr(runtime, "add_stages_inspection_hook", None),
    )


def _learn(kernel, device: int, grid, args: tuple, constexprs: dict, knob_state: tuple) -> None:
    """Launch through Triton's normal path once, recording the keyword options run() hands
    its binder (debug and the like, process-wide knobs) beside ours."""
    global _ENABLED
    _STATS["slow"] += 1
    try:
        caches = kernel.device_caches[device]
        kernel_cache, key_cache, _target, _backend, binder = caches
    except (AttributeError, TypeError, ValueError):
        _ENABLED = False
        kernel[grid](*args, **constexprs)
        return
    seen: dict = {}

    def spy(*a, **kw):
        seen.update(kw)
        return binder(*a, **kw)

    kernel.device_caches[device] = (*caches[:4], spy)
    try:
        kernel[grid](*args, **constexprs)
    finally:
        kernel.device_caches[device] = caches
    extra = {k: v for k, v in seen.items() if k not in constexprs}
    _LEARNED[(kernel, device)] = (binder, kernel_cache, key_cache, extra, knob_state)


def op_or_impl(op, impl):
    """The registered custom op while torch.compile traces (it sees one opaque op with its fake),
    else its implementation called directly: in eager mode the dispatcher's round trip through
    the custom op (Python -> C++ -> Python, with dynamo's disable wrapper) adds tens of
    microseconds on a slow host and changes nothing."""
    return op if torch.compiler.is_compiling() else impl


def _raw_stream(device: int) -> int:
    """The current CUDA stream's handle, as Triton's driver asks torch for it (torch's private
    getter, which torch.compile's generated code uses too; the public path builds a Stream
    object each call)."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:  # pragma: no cover - an older torch
        return torch.cuda.current_stream(device).cuda_stream
    return getter(device)
