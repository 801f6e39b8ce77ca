"""Writes to the registers of a wgmma still in flight, found in a kernel's SASS.

A wgmma (SASS HGMMA) reads its register operands (the left operand A where it comes from
registers, and the accumulator) asynchronously, until the WARPGROUP.DEPBAR that retires its
group; an instruction that writes one of those registers before then corrupts the product. In
a loop the PTX names an operand's registers once for every iteration, so a kernel that decodes
the next iteration's operand while the last wgmma runs writes them under it (the first form
of the wide prefill tile did; docs/performance.md). in_flight_writes walks each loop body that
holds an HGMMA twice (the back edge) and reports such writes.

It reads `cuobjdump -sass` output as it is (the addresses on each line find the loops;
triton.tools.disasm.get_sass drops them, and yields no instruction here). Heuristic by design,
for the kernels it was written for: an instruction's destination is its first operand when
that is a general register, one register wide unless the opcode says .64, .128 or .WIDE;
stores, async copies and compares write none. Missed: instructions whose first operand is a
predicate (SHFL), atomics that return a value, and wider writes that do not say so (LDSM .x4,
CS2R).
"""

from __future__ import annotations

import re

__all__ = ["hgmma_loops", "in_flight_writes", "instructions"]

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_NO_DEST = ("ST", "LDGSTS", "BAR", "RED", "ATOM", "ISETP", "FSETP", "HSETP", "DSETP", "BRA")


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, text) of each instruction of `cuobjdump -sass` output, predicate included."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_LINE.search, sass.splitlines()) if m]


def _width(op: str) -> int:
    if ".128" in op:
        return 4
    return 2 if ".64" in op or ".WIDE" in op else 1


def _operands(text: str) -> tuple[str, list[int], list[int]] | None:
    """An HGMMA's (shape, accumulator registers, register-A registers); None for another."""
    m = re.match(r"HGMMA\.64x(\d+)x\d+\.F32\S*\s+R(\d+),\s*(\S+)", text)
    if m is None:
        return None
    acc = list(range(int(m.group(2)), int(m.group(2)) + int(m.group(1)) // 2))
    a = re.fullmatch(r"R(\d+),?", m.group(3))
    return m.group(0), acc, [] if a is None else list(range(int(a.group(1)), int(a.group(1)) + 4))


def hgmma_loops(sass: str) -> list[list[str]]:
    """The bodies (instruction texts) of the loops that issue an HGMMA: from a backward
    branch's target to the branch."""
    code = instructions(sass)
    bodies = []
    for address, text in code:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < address:
            body = [t for a, t in code if int(m.group(1), 16) <= a <= address]
            if any(re.sub(r"^@!?U?P[0-9T]\s+", "", t).startswith("HGMMA") for t in body):
                bodies.append(body)
    return bodies


def in_flight_writes(sass: str) -> list[str]:
    """The instructions (of loops with an HGMMA) that write a register of a wgmma group in
    flight: its register A operand, or its accumulator written by anything but an HGMMA."""
    found = []
    for body in hgmma_loops(sass):
        groups: list[set[int]] = []  # in flight, oldest first
        current: set[int] = set()  # the group being issued
        for lap in range(2):
            for text in body:
                bare = re.sub(r"^@!?U?P[0-9T]\s+", "", text)
                op = bare.split()[0]
                parsed = _operands(bare)
                if parsed is not None:
                    _, acc, a = parsed
                    current |= set(a) | {-r - 1 for r in acc}  # accumulators negated
                    if "gsb0" in bare:
                        groups.append(current)
                        current = set()
                    continue
                m = re.match(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", bare)
                if m:
                    keep = int(m.group(1), 16)
                    groups = groups[max(0, len(groups) - keep) :] if keep else []
                    continue
                d = re.match(r"\S+\s+R(\d+)\b", bare)
                if d is None or op.startswith(_NO_DEST):
                    continue
                written = set(range(int(d.group(1)), int(d.group(1)) + _width(op)))
                live = set().union(current, *groups)
                hit = written & {r for r in live if r >= 0} | {r for r in written if -r - 1 in live}
                if hit and lap == 1:
                    found.append(f"{bare}  (registers {sorted(hit)})")
    return found
