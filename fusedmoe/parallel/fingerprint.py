"""The fingerprint the ranks of an EP group compare before they exchange tokens, so that a rank
built with another layer fails at once with a ValueError instead of hanging a collective or
summing rows of another shape.

    LayerFingerprint(fields)   (name, value) pairs: ints, bools and strings that every rank's
                               layer must share (E, k, H, I, dtype, quant scheme, placement,
                               dispatch kind, max tokens, chunking, ...)
    codes()                    one int64 per field: the value (ints, bools) or 56 bits of a
                               hash (strings), gathered with the call's token count
    disagreement(...)          the gathered codes of every rank -> the error naming each field
                               and the ranks on each side, or None

The naive and all_to_all dispatches gather the codes with the token counts they exchange on
every call anyway (no extra collective, so a layer changed on one rank later, by quantize_ or
set_backend, is caught too); symm_mem, whose calls make no host sync, gathers them once, at its
first call (the warm-up before a CUDA graph is captured).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

__all__ = ["LayerFingerprint", "disagreement"]

_INT64_MAX = (1 << 63) - 1


def _code(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and -_INT64_MAX <= value <= _INT64_MAX:
        return value
    digest = hashlib.blake2b(repr(value).encode(), digest_size=7).digest()
    return int.from_bytes(digest, "little")


@dataclass(frozen=True)
class LayerFingerprint:
    fields: tuple[tuple[str, object], ...]  # (name, value), the same order on every rank

    @functools.cached_property
    def _codes(self) -> tuple[int, ...]:
        return tuple(_code(value) for _, value in self.fields)  # hashed once, not per call

    def codes(self) -> list[int]:
        return list(self._codes)

    def __len__(self) -> int:
        return len(self.fields)


def disagreement(table: list[list[int]], fingerprint: LayerFingerprint, rank: int) -> str | None:
    """table[r]: rank r's codes (LayerFingerprint.codes, the same length everywhere) -> None
    where every rank agrees, else what differs: for each field, the ranks holding each value
    (the value itself for numbers; for strings this rank's, the others' as 'another value')."""
    parts = []
    for j, (name, value) in enumerate(fingerprint.fields):
        groups: dict[int, list[int]] = {}
        for r, codes in enumerate(table):
            groups.setdefault(codes[j], []).append(r)
        if len(groups) == 1:
            continue
        numeric = isinstance(value, (bool, int))
        sides = []
        for code, ranks in groups.items():
            if numeric:
                shown = repr(bool(code) if isinstance(value, bool) else code)
            elif rank in ranks:
                shown = f"{value!r} (this rank)"
            else:
                shown = "another value"
            sides.append(f"ranks {ranks} have {shown}")
        parts.append(f"{name}: " + ", ".join(sides))
    if not parts:
        return None
    return (
        "the ranks of the EP group were built with different layers (compared before any "
        "tokens travel): " + "; ".join(parts)
    )
