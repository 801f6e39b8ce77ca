"""Kernel configs of the Triton expert GEMMs: a small deterministic heuristic, overridden by
tuned tables (written by `fusedmoe tune`) when one exists for the shape and this GPU.

A config is frozen per (E_l, N, K, M bucket, dtype, device). Tables are JSON files named

    <device name>/E=<E_l>,N=<N>,K=<K>,dtype=<dtype>.json     {"<M>": {config fields}, ...}

looked up first in the user's directory ($FUSEDMOE_TUNED_CONFIGS, else <cache dir>/tuned, where
`fusedmoe tune` writes by default; the cache dir is $FUSEDMOE_CACHE_DIR or ~/.cache/fusedmoe),
then in the tables shipped in fusedmoe/kernels/tuned/; the entry of the nearest M is used.
N is the w13 rows per expert (2I gated), K the hidden size.

Beside them, for fp8_block, `fusedmoe tune` records which GEMM engine of the deep_gemm backend
was faster per bucket where both run (the DeepGEMM library's GEMMs or our wgmma ones):

    <device name>/engines/E=<E_l>,N=<N>,K=<K>,dtype=fp8_block.json
        {"<M>": {"engine": "library" | "wgmma", "library_ms": [...], "wgmma_ms": [...]}, ...}

(the times: medians under uniform and skewed routing, the evidence kept with the choice).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from fusedmoe._paths import CACHE_ENV, user_tuned_dir
from fusedmoe._triton import next_power_of_2

__all__ = [
    "TABLE_ENGINES",
    "TUNED_CONFIGS_ENV",
    "GemmConfig",
    "MoEKernelConfig",
    "engine_table",
    "engine_table_path",
    "measured_engine",
    "moe_kernel_config",
    "table_path",
    "use_moe_kernel_config",
    "user_tables_dir",
]

TUNED_CONFIGS_ENV = "FUSEDMOE_TUNED_CONFIGS"
SHIPPED_DIR = Path(__file__).parent / "tuned"


@dataclass(frozen=True)
class GemmConfig:
    block_n: int  # output columns per program (GEMM1 gated: of the activation, 2x of w13 rows)
    block_k: int  # reduced width per step (divides 128 for 128-block FP8)
    #: launch order: group_m row blocks take every column tile, then the next group_m row
    #: blocks (they share each tile of w while it is in L2). A group_m of at least the call's
    #: row blocks (1024 in the tuned tables) takes the columns first: every wave holds the row
    #: blocks of every expert for a few column tiles
    group_m: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoEKernelConfig:
    block_m: int  # rows per block of the aligned layout (shared by both GEMMs)
    gemm1: GemmConfig
    gemm2: GemmConfig
    #: gated activation (+ group quantization) in GEMM1's epilogue (two accumulators, gate and
    #: up); False: GEMM1 stores h and a separate fused act + quant kernel reads it (one
    #: accumulator: taller tiles fit in registers). Only 1 x 128 group FP8 a2 uses False.
    fuse_activation: bool = True

    def to_json(self) -> dict:
        return {
            "block_m": self.block_m,
            "gemm1": asdict(self.gemm1),
            "gemm2": asdict(self.gemm2),
            "fuse_activation": self.fuse_activation,
        }

    @classmethod
    def from_json(cls, entry: object, where: str) -> MoEKernelConfig:
        try:
            gemms = {
                name: GemmConfig(**{f.name: int(entry[name][f.name]) for f in fields(GemmConfig)})
                for name in ("gemm1", "gemm2")
            }
            fuse = entry.get("fuse_activation", True)
            if not isinstance(fuse, bool):
                raise TypeError(f"fuse_activation must be a bool, got {fuse!r}")
            config = cls(block_m=int(entry["block_m"]), **gemms, fuse_activation=fuse)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: not a fusedmoe kernel config ({exc!r})") from None
        config.check(where)
        return config

    def check(self, where: str = "config") -> None:
        sizes = [self.block_m] + [
            v for g in (self.gemm1, self.gemm2) for v in (g.block_n, g.block_k, g.num_warps)
        ]
        if any(v <= 0 or v & (v - 1) for v in sizes) or self.block_m < 16:
            raise ValueError(f"{where}: block sizes and warps must be powers of two, block_m >= 16")
        for name, g in (("gemm1", self.gemm1), ("gemm2", self.gemm2)):
            if g.group_m < 1 or g.num_stages < 1:
                raise ValueError(
                    f"{where}: {name} group_m and num_stages must be at least 1, got "
                    f"{g.group_m} and {g.num_stages}"
                )


_override: contextvars.ContextVar[MoEKernelConfig | None] = contextvars.ContextVar(
    "fusedmoe_moe_kernel_config", default=None
)


@contextlib.contextmanager
def use_moe_kernel_config(config: MoEKernelConfig) -> Iterator[None]:
    """Scoped override (tests, benchmarks, tuning): every launch inside uses `config`."""
    config.check()
    token = _override.set(config)
    try:
        yield
    finally:
        _override.reset(token)


def user_tables_dir() -> Path:
    """$FUSEDMOE_TUNED_CONFIGS, else the user cache's tuned/ (fusedmoe tune's default --out)."""
    env = os.environ.get(TUNED_CONFIGS_ENV)
    return Path(env) if env else user_tuned_dir()


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def table_path(root: Path, device_name: str, e: int, n: int, k: int, dtype: str) -> Path:
    return root / _safe(device_name) / f"E={e},N={n},K={k},dtype={dtype}.json"


def _read_table(p: Path, what: str, entry_of) -> dict:
    """{M: entry_of(entry, where)} of a JSON table {"<M>": entry}; a clear ValueError for
    anything else."""
    try:
        raw = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{what} {p} is not readable JSON: {exc}") from None
    if not isinstance(raw, dict) or not raw:
        raise ValueError(f"{what} {p}: expected an object of token counts -> entries")
    table = {}
    for m, entry in raw.items():
        if not str(m).isdigit():
            raise ValueError(f"{what} {p}: key {m!r} is not a token count")
        table[int(m)] = entry_of(entry, f"{what} {p} [{m}]")
    return table


def _nearest(table: dict, m: int):
    """The entry of the token count nearest m (the smaller on a tie)."""
    return table[min(table, key=lambda key: (abs(key - m), key))]


@functools.lru_cache(maxsize=256)
def _load_table(path: str) -> dict[int, MoEKernelConfig] | None:
    p = Path(path)
    if not p.is_file():
        return None
    return _read_table(p, "tuned config table", MoEKernelConfig.from_json)


def _tuned(device_name: str | None, e: int, n: int, k: int, dtype: str, m: int):
    if device_name is None:
        return None
    for root in (user_tables_dir(), SHIPPED_DIR):
        table = _load_table(str(table_path(root, device_name, e, n, k, dtype)))
        if table:
            return _nearest(table, m)
    return None


#: the deep_gemm backend's GEMM engines an engine table may name
TABLE_ENGINES = ("library", "wgmma")


def engine_table_path(root: Path, device_name: str, e: int, n: int, k: int, dtype: str) -> Path:
    return root / _safe(device_name) / "engines" / f"E={e},N={n},K={k},dtype={dtype}.json"


def _load_engine_table(path: Path) -> dict[int, str] | None:
    """The table at path, or None; read again when the file changes (tune writes it)."""
    if not path.is_file():
        return None
    return _parse_engine_table(str(path), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _parse_engine_table(path: str, _mtime_ns: int) -> dict[int, str]:
    return _read_table(Path(path), "engine table", _engine_of)


def _engine_of(entry: object, where: str) -> str:
    engine = entry.get("engine") if isinstance(entry, dict) else None
    if engine not in TABLE_ENGINES:
        raise ValueError(f"{where}: expected {{'engine': one of {TABLE_ENGINES}}}, got {entry!r}")
    return engine


def engine_table(
    num_local_experts: int, gemm1_rows: int, hidden_size: int, dtype: str, device_name: str
) -> tuple[dict[int, str], Path] | None:
    """The measured engine table of a shape on this device (the user's first, then the
    shipped one) and its path, or None where none was measured."""
    for root in (user_tables_dir(), SHIPPED_DIR):
        path = engine_table_path(
            root, device_name, num_local_experts, gemm1_rows, hidden_size, dtype
        )
        table = _load_engine_table(path)
        if table:
            return table, path
    return None


def measured_engine(
    num_tokens: int,
    num_local_experts: int,
    gemm1_rows: int,
    hidden_size: int,
    dtype: str,
    device_name: str | None,
) -> str | None:
    """The engine measured faster at the nearest bucket of this shape on this device, or None
    (no table, or the interpreter: device_name None)."""
    if device_name is None:
        return None
    return _measured_engine(
        num_tokens, num_local_experts, gemm1_rows, hidden_size, dtype, device_name,
        os.environ.get(TUNED_CONFIGS_ENV), os.environ.get(CACHE_ENV),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _measured_engine(
    num_tokens, num_local_experts, gemm1_rows, hidden_size, dtype, device_name, _env, _cache
) -> str | None:  # resolved once per signature, as _resolved_config is
    found = engine_table(num_local_experts, gemm1_rows, hidden_size, dtype, device_name)
    if found is None:
        return None
    return _nearest(found[0], num_tokens)


def moe_kernel_config(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    gemm1_rows: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: str,
    device_name: str | None,
) -> MoEKernelConfig:
    """The config of one call: the scoped override, else the tuned table, else the heuristic.

    dtype is the operand kind: "bfloat16", "float16", "float32", "fp8_tensor", "fp8_channel",
    "fp8_block" or "int8"; device_name None (the interpreter) skips the tables.
    """
    override = _override.get()
    if override is not None:
        return override
    # resolved once per signature (the table lookup walks paths: ~100 us on a slow host); the
    # table directories are part of the key, so changing them between calls is seen
    return _resolved_config(
        num_tokens, top_k, num_local_experts, gemm1_rows, hidden_size, intermediate_size, dtype,
        device_name, os.environ.get(TUNED_CONFIGS_ENV), os.environ.get(CACHE_ENV),
    )  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _resolved_config(
    num_tokens, top_k, num_local_experts, gemm1_rows, hidden_size, intermediate_size, dtype,
    device_name, _tables_env, _cache_env,
) -> MoEKernelConfig:  # fmt: skip
    tuned = _tuned(device_name, num_local_experts, gemm1_rows, hidden_size, dtype, num_tokens)
    if tuned is not None:
        return tuned
    return heuristic_config(
        num_tokens, top_k, num_local_experts, hidden_size, intermediate_size, dtype
    )


def heuristic_config(
    num_tokens: int,
    top_k: int,
    num_local_experts: int,
    hidden_size: int,
    intermediate_size: int,
    dtype: str,
) -> MoEKernelConfig:
    """Rows per block from the expected slots per expert (uniform routing): 16-row blocks
    while experts see a few tokens (decode: weight-read bound, a taller tile only multiplies
    zeros), then 64 and 128 (tensor-core bound).

    The tiles are the winners of sweeps on an H200 (qwen3-30b-a3b, deepseek-v3 and gpt-oss-120b
    shapes, uniform and Zipf-skewed routing):
    - decode (<= 4 slots per expert): the tile hardly matters (+-2%);
    - from ~8 slots per expert, 16-row blocks lose to 64-row ones by 30-50% under skewed
      routing (a popular expert's rows become many thin tiles) and win by only ~3% under
      uniform routing, so 64 rows take over early (the tuned tables also take 32 or 64 rows at
      2 slots per expert where a skewed routing's popular experts pay for 16);
    - prefill: 128 x 128 (x2, gate and up) bf16 tiles with 4 stages; 128-block FP8 stays at 64
      rows (its per-K-block promotion keeps a second accumulator live: 128 rows spill).
    """
    per_expert = num_tokens * top_k / max(num_local_experts, 1)
    block_m = 16 if per_expert <= 4 else 64 if per_expert <= 48 else 128
    one_byte = dtype.startswith("fp8") or dtype == "int8"
    if dtype == "fp8_block":
        block_m = min(block_m, 64)
    if dtype == "float32":  # 4-byte operands: half the K per stage, fewer stages
        block_k, stages = 32, 2
    else:
        block_k, stages = (128 if one_byte else 64), 4
    if block_m == 16:  # decode: many programs in flight, deep pipelines on the weight reads
        # group_m: the row blocks of a popular expert (skewed routing) run side by side, so
        # they read each weight tile from HBM once and from L2 after
        decode_k = block_k if one_byte else 2 * block_k
        gemm1 = GemmConfig(32, decode_k, 8, 4, stages)
        gemm2 = GemmConfig(64, decode_k, 8, 4, stages)
    else:
        warps = 8 if block_m == 128 or dtype == "fp8_block" else 4
        gemm1 = GemmConfig(128 if block_m == 128 else 64, block_k, 8, warps, stages)
        gemm2 = GemmConfig(256 if warps == 8 else 128, block_k, 8, warps, stages)
    if dtype == "fp8_block":  # whole 128-wide groups for the fused group quantization
        gemm1 = GemmConfig(128, 128, gemm1.group_m, gemm1.num_warps, min(stages, 3))
    return MoEKernelConfig(
        block_m,
        _fit(gemm1, intermediate_size, hidden_size),
        _fit(gemm2, hidden_size, intermediate_size),
    )


def _fit(config: GemmConfig, n: int, k: int) -> GemmConfig:
    """Shrink the tile to small shapes (tl.dot needs at least 16 along each dimension)."""
    block_k = config.block_k
    if block_k != 128:  # 128 stays for the block scales
        block_k = max(16, min(block_k, next_power_of_2(k)))
    block_n = config.block_n
    if block_n % 128:
        block_n = max(16, min(block_n, next_power_of_2(n)))
    return GemmConfig(block_n, block_k, config.group_m, config.num_warps, config.num_stages)
