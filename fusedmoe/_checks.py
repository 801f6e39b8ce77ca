"""Input checks shared by every public entry point.

Every check raises ValueError or TypeError naming the argument, what was expected and what
was given, before any kernel runs. Checks on tensor *values* (ids in range) need a
device-to-host copy; they run eagerly, and are skipped while a CUDA graph is being captured or
torch.compile is tracing, where a sync is impossible (see `value_checks_enabled`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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


def value_checks_enabled(t: torch.Tensor) -> bool:
    """Whether checks that read tensor values (and so synchronise) may run now."""
    if torch.compiler.is_compiling():
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_ids_in_range(name: str, ids: torch.Tensor, low: int, high: int) -> None:
    """ids must lie in [low, high); skipped under graph capture and compilation."""
    if ids.numel() == 0 or not value_checks_enabled(ids):
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < low or hi >= high:
        raise ValueError(f"{name} must lie in [{low}, {high}), got values in [{lo}, {hi}]")
