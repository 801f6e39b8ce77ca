"""tests/sass_check.py: writes to the registers of a wgmma in flight, on hand-made SASS (the
CPU), and none in the Hopper weight-only kernels as they compile on the GPU."""

from __future__ import annotations

import subprocess
import tempfile

import pytest
import torch

from tests.sass_check import hgmma_loops, in_flight_writes, instructions


def _sass(*lines: str) -> str:
    """cuobjdump-style lines, one instruction each, from address 0x0100 in steps of 0x10."""
    return "\n".join(
        f"        /*{0x100 + 16 * i:04x}*/    {text} ;" for i, text in enumerate(lines)
    )


HGMMA = "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8], R24, gsb0"


def test_instructions_reads_addresses_and_text():
    code = instructions(_sass("MOV R1, R2", "@P6 BRA 0x100"))
    assert code == [(0x100, "MOV R1, R2"), (0x110, "@P6 BRA 0x100")]


def test_text_without_addresses_has_no_instruction():
    """triton.tools.disasm.get_sass's form (no addresses, branch targets as labels) is not
    read: no instruction, no loop (the GPU test asserts it found loops)."""
    text = "--:-:-:Y:1\tLOP3.LUT R152, R3, 0xff, RZ, 0xc0, !PT;\n--:-:-:Y:5\t@P6 BRA `(.L_x_1);"
    assert instructions(text) == [] and hgmma_loops(text) == []


def test_an_operand_rewritten_before_its_wgmma_retires_is_found():
    """The loop's top writes A (R152) while the last iteration's wgmma, left in flight by
    DEPBAR.LE 1, still reads it: found on the second lap, not the first."""
    sass = _sass(
        "LOP3.LUT R152, R3, 0xff, RZ, 0xc0, !PT",
        "WARPGROUP.ARRIVE",
        HGMMA,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
        "@P6 BRA 0x100",
    )
    found = in_flight_writes(sass)
    assert len(found) == 1 and found[0].startswith("LOP3.LUT R152") and "[152]" in found[0]


def test_an_operand_written_after_its_wgmma_retired_is_not():
    sass = _sass(
        "LOP3.LUT R152, R3, 0xff, RZ, 0xc0, !PT",
        "IMAD.WIDE R154, R3, 0x2, R4",  # R154, R155: A too, but written before the issue
        "WARPGROUP.ARRIVE",
        HGMMA,
        "WARPGROUP.DEPBAR.LE gsb0, 0x0",
        "@P6 BRA 0x100",
    )
    assert in_flight_writes(sass) == []


def test_two_operand_sets_alternate_safely_and_a_wide_write_is_caught():
    """Two groups, each retired before its registers are written again: clean. A 64-bit write
    reaching into the other group's operand while it runs: found."""
    clean = _sass(
        "LOP3.LUT R152, R3, 0xff, RZ, 0xc0, !PT",
        "WARPGROUP.ARRIVE",
        HGMMA,
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # the other set's wgmma retired
        "LOP3.LUT R160, R3, 0xff, RZ, 0xc0, !PT",
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R88, R160, gdesc[UR8], R88, gsb0",
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",  # the first set's retired
        "@P6 BRA 0x100",
    )
    assert in_flight_writes(clean) == []
    wide = clean.replace("LOP3.LUT R160, R3", "IMAD.WIDE R151, R3")  # R151, R152: A in flight
    found = in_flight_writes(wide)
    assert found and all("[152]" in f for f in found)


def test_an_accumulator_written_in_flight_is_found_but_not_by_the_next_wgmma():
    base = [
        "WARPGROUP.ARRIVE",
        "HGMMA.64x128x16.F32.BF16 R24, R152, gdesc[UR8], R24",
        "HGMMA.64x128x16.F32.BF16 R24, R156, gdesc[UR8], R24, gsb0",  # chains the accumulator
        "WARPGROUP.DEPBAR.LE gsb0, 0x1",
    ]
    assert in_flight_writes(_sass(*base, "@P6 BRA 0x100")) == []
    found = in_flight_writes(_sass(*base, "FADD R30, R30, 1", "@P6 BRA 0x100"))
    assert len(found) == 1 and "[30]" in found[0]  # R24 .. R87 is the accumulator


def test_code_outside_loops_and_loops_without_wgmma_are_not_walked():
    sass = _sass(
        "WARPGROUP.ARRIVE",
        HGMMA,
        "LOP3.LUT R152, R3, 0xff, RZ, 0xc0, !PT",  # in flight, but in no loop
        "IADD3 R1, R1, 1, RZ",
        "@P0 BRA 0x130",  # a loop of its own, without an HGMMA
    )
    assert in_flight_writes(sass) == []


@pytest.mark.gpu
def test_hopper_weight_only_kernels_write_no_register_of_a_wgmma_in_flight():
    """Both forms of wo_hopper's Gluon kernels (decode tiles of 16 and 64 slots, the prefill
    tile of 128; gated and not), compiled as they run, read from Triton's cache and
    disassembled with cuobjdump: each has a loop issuing wgmma, and no instruction writes a
    register a wgmma in flight reads."""
    from triton.tools.disasm import path_to_cuobjdump

    from fusedmoe import fused_experts
    from fusedmoe.kernels import wo_hopper
    from fusedmoe.kernels.wo_hopper_prefill import wo_mx_hopper_prefill_kernel as prefill_kernel
    from fusedmoe.kernels.wo_moe import WoConfig, WoGemmConfig, use_wo_config
    from fusedmoe.quant import quantize_experts
    from tests.helpers import random_routing

    dev = torch.zeros(1, device="cuda")
    if wo_hopper.gluon is None or wo_hopper._device_reason(dev.device.index or 0) is not None:
        pytest.skip("the Gluon kernels need Hopper and Triton 3.6")
    e, k, h, i = 8, 4, 256, 320
    for activation in ("silu", "relu2_no_mul"):
        gated = activation == "silu"
        w13 = torch.randn(e, 2 * i if gated else i, h, device="cuda").bfloat16() * 0.05
        w2 = torch.randn(e, h, i, device="cuda").bfloat16() * 0.05
        q13, q2, qc = quantize_experts(w13, w2, "mxfp4_w4a16")
        for block_m, m in ((16, 8), (64, 64), (128, 300)):
            x = torch.randn(m, h, device="cuda").bfloat16()
            weights, ids = random_routing(m, e, k, device="cuda")
            gemm = WoGemmConfig(64, 128, 8, 4, 2)
            with use_wo_config(WoConfig(block_m, gemm, gemm)):
                fused_experts(x, q13, q2, weights, ids, quant_config=qc, activation=activation)
    torch.cuda.synchronize()
    cuobjdump = path_to_cuobjdump()
    for fn, least in ((wo_hopper._wo_mx_hopper_kernel, 4), (prefill_kernel, 2)):
        compiled = [c for cache in fn.device_caches.values() for c in cache[0].values()]
        assert len(compiled) >= least, f"{fn.__name__}: fewer variants compiled than launched"
        for kernel in compiled:
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(kernel.asm["cubin"])
                f.flush()
                sass = subprocess.check_output([cuobjdump, "-sass", f.name], text=True)
            assert hgmma_loops(sass), f"{kernel.name}: no loop with a wgmma found in its SASS"
            assert in_flight_writes(sass) == [], kernel.name
