"""tools.ep_bench on 2 gloo processes, shrunken: the table's rows, traffic and the check."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

import pytest
import torch.distributed as dist

from fusedmoe.parallel.symm_mem_ep import TRANSPORT_ENV
from fusedmoe.tools.ep_bench import main, parse_args
from tests.helpers import free_port, spawn_ranks


def _bench_worker(rank: int, port: int, argv: list[str], path: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )  # fmt: skip
    code = main(argv)
    with open(f"{path}.rank{rank}", "w") as f:
        f.write(str(code))


needs_gloo = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed gloo"
)


def _run_bench(argv: list[str], path: str) -> dict:
    spawn_ranks(_bench_worker, (free_port(), argv, path), 2, 120, "the benchmark")
    codes = [pathlib.Path(f"{path}.rank{r}").read_text() for r in range(2)]
    assert codes == ["0", "0"]
    with open(path) as f:
        return json.load(f)


@needs_gloo
def test_ep_bench_on_two_cpu_processes():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        argv = ["--device", "cpu", "--scale", "32", "--tokens", "4,7", "--dtypes", "bf16",
                "--iters", "1", "--warmup", "0", "--check", "--json", path]  # fmt: skip
        report = _run_bench(argv, path)
    rows = report["rows"]
    assert [(r["kind"], r["tokens_per_rank"]) for r in rows] == [
        ("naive", 4), ("naive", 7), ("all_to_all", 4), ("all_to_all", 7),
    ]  # fmt: skip
    for row in rows:
        assert row["ranks"] == 2 and row["forward_ms"] > 0
        assert row["dispatch_bytes"] > 0 and row["combine_bytes"] > 0
        # the smallest count is checked against the unsharded layer
        assert row["check"].startswith("ok") if row["tokens_per_rank"] == 4 else not row["check"]
    naive, a2a = rows[0], rows[2]
    assert a2a["dispatch_bytes"] <= naive["dispatch_bytes"]


@needs_gloo
def test_ep_bench_symm_mem_over_the_emulated_transport(monkeypatch):
    """The symm_mem kind's rows (its traffic read on the host where the bench asks), checked
    against the unsharded layer, on gloo through the emulated transport."""
    monkeypatch.setenv(TRANSPORT_ENV, "emulated")  # the spawned ranks inherit it
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "bench.json")
        argv = ["--device", "cpu", "--scale", "32", "--tokens", "3,6", "--dtypes",
                "bf16,fp8_block", "--kinds", "symm_mem,all_to_all", "--iters", "1", "--warmup",
                "0", "--check", "--json", path]  # fmt: skip
        rows = _run_bench(argv, path)["rows"]
    assert [(r["dtype"], r["kind"], r["tokens_per_rank"]) for r in rows] == [
        (d, k, t) for d in ("bf16", "fp8_block") for k in ("symm_mem", "all_to_all") for t in (3, 6)
    ]
    # the bytes of a dispatch row (H = 224): all_to_all's payload, symm_mem's row as it
    # travels (x, then ids | weights (| scales) as int32 words, padded to 64 bytes)
    row_bytes = {"bf16": (448 + 64, 512), "fp8_block": (224 + 8 + 64, 320)}
    for symm, a2a in [(rows[i], rows[i + 2]) for i in (0, 1, 4, 5)]:
        assert symm["kind"] == "symm_mem" and a2a["kind"] == "all_to_all"
        assert symm["tokens_per_rank"] == a2a["tokens_per_rank"]
        # the same tokens travel to the same ranks: the same rows, each of its kind's size
        a2a_row, symm_row = row_bytes[symm["dtype"]]
        assert symm["dispatch_bytes"] * a2a_row == a2a["dispatch_bytes"] * symm_row > 0
        assert symm["combine_bytes"] == a2a["combine_bytes"] > 0  # bf16 rows of 448 bytes
    for row in rows:
        assert row["check"].startswith("ok") if row["tokens_per_rank"] == 3 else not row["check"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--tokens", "a"], "--tokens must be a comma list"),
        (["--kinds", "deepep"], "--kinds"),
        (["--iters", "0"], "--iters must be >= 1"),
        (["--combine-blocks", "0"], "--combine-blocks must be >= 1"),
        (["--routing-first", "yes"], "--routing-first"),
    ],
)
def test_ep_bench_arguments(argv, match, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert match in capsys.readouterr().err


def test_bench_ep_needs_torchrun(monkeypatch, capsys):
    from fusedmoe.tools.cli import main as cli_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert cli_main(["bench", "--ep", "2"]) == 2
    assert "torchrun --nproc-per-node 2 -m fusedmoe bench --ep 2" in capsys.readouterr().err


def test_bench_ep_hands_its_flags_to_ep_bench(monkeypatch):
    from fusedmoe.tools import ep_bench
    from fusedmoe.tools.cli import main as cli_main

    seen = []
    monkeypatch.setattr(ep_bench, "main", lambda argv: seen.append(argv) or 0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = ["bench", "--ep", "4", "--preset", "qwen3-30b-a3b", "--quant", "bf16,fp8_block",
            "--tokens", "64,1024", "--ep-kinds", "all_to_all", "--device", "cpu",
            "--check"]  # fmt: skip
    assert cli_main(argv) == 0
    expected = ["--preset", "qwen3-30b-a3b", "--dtypes", "bf16,fp8_block", "--kinds",
                "all_to_all", "--tokens", "64,1024", "--device", "cpu", "--check"]  # fmt: skip
    assert seen == [expected]
    parse_args(expected)  # ep_bench accepts what the CLI hands it
    assert cli_main(["bench", "--ep", "4", "--preset", "qwen3-30b-a3b,deepseek-v3"]) == 2
