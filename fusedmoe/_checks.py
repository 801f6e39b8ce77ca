"""Input checks shared by every public entry point.

Every check raises ValueError or TypeError naming the argument, what was expected and what
was given, before any kernel runs. Shapes, dtypes and devices are always checked (they cost no
device sync). Checks on tensor *values* (ids in range, expert_map entries) read the tensor on
the host: free for CPU tensors, always done there; for a GPU tensor a device-to-host sync that
stalls the launch queue, so they run only in debug mode:

    FUSEDMOE_DEBUG_CHECKS=1            (environment, read at each call)
    fusedmoe.set_debug_checks(True)    (process-wide; None returns to the environment)
    with fusedmoe.debug_checks(): ...  (scoped)

Without debug mode the kernels never read or write out of bounds: an id outside [0, E) or an
expert_map entry outside [0, E_l) is treated as a slot routed to no expert here (it adds
nothing). Value checks are also skipped while a CUDA graph is captured or torch.compile traces.
"""

from __future__ import annotations

import contextlib
import enum
import os
from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


E = TypeVar("E", bound=enum.Enum)


def parse_enum(cls: type[E], value: object, arg_name: str) -> E:
    """A member of `cls`, given as itself or by its value in any case; else a clear error."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            return cls(value.lower())
        except ValueError:
            pass
        raise ValueError(f"unknown {arg_name} {value!r}; expected one of {[m.value for m in cls]}")
    raise TypeError(f"{arg_name} must be a {cls.__name__} or a str, got {type(value).__name__}")


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (the device of the input)")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


DEBUG_CHECKS_ENV = "FUSEDMOE_DEBUG_CHECKS"
_debug_override: bool | None = None


def debug_checks_enabled() -> bool:
    """Whether value checks that synchronise with a GPU run (see the module docstring)."""
    if _debug_override is not None:
        return _debug_override
    return os.environ.get(DEBUG_CHECKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_debug_checks(enabled: bool | None) -> None:
    """Turn the GPU value checks on or off for the process; None: follow FUSEDMOE_DEBUG_CHECKS."""
    global _debug_override
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool or None, got {type(enabled).__name__}")
    _debug_override = enabled


@contextlib.contextmanager
def debug_checks(enabled: bool = True) -> Iterator[None]:
    """Scoped set_debug_checks: `with fusedmoe.debug_checks(): layer(x, logits)`."""
    global _debug_override
    previous = _debug_override
    set_debug_checks(enabled)
    try:
        yield
    finally:
        _debug_override = previous


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read tensor values may run now: always on the CPU (no device sync),
    on a GPU in debug mode only, never while tracing or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    if t.device.type == "cpu":
        return True
    if not debug_checks_enabled():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_ids_in_range(
    name: str, ids: torch.Tensor, low: int, high: int, *, once: bool = False
) -> None:
    """ids must lie in [low, high). Per call: as value_checks_enabled says; `once` (a check at
    construction, not per call) runs on a GPU too, outside graph capture and tracing."""
    if ids.numel() == 0:
        return
    if once:
        if torch.compiler.is_compiling() or (
            ids.is_cuda and torch.cuda.is_current_stream_capturing()
        ):
            return
    elif not value_checks_enabled(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < low or hi >= high:
        raise ValueError(f"{name} must lie in [{low}, {high}), got values in [{lo}, {hi}]")


def check_ids_distinct(name: str, ids: torch.Tensor) -> None:
    """The non-negative ids of each row of ids [M, k] are distinct (as value_checks_enabled
    says: always on the CPU, in debug mode on a GPU)."""
    if ids.numel() == 0 or ids.shape[1] < 2 or not value_checks_enabled(ids):
        return
    ordered = ids.sort(dim=1).values
    repeated = (ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] >= 0)
    if bool(repeated.any()):
        row = int(repeated.any(dim=1).nonzero()[0])
        raise ValueError(f"{name} repeats an expert in row {row}: {ids[row].tolist()}")
