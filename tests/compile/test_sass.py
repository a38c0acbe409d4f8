"""numba_flash.tools.sass on hand-written listings: the loop it finds, the path it counts and the
figures it derives (no toolchain needed; the compile tier runs it on every real kernel)."""

from __future__ import annotations

import pytest

from numba_flash.tools import sass

HEAD = ".text.kern:\n"


def listing(*lines):
    """An nvdisasm-style listing: ``label:`` lines and instructions, addresses 0x10 apart."""
    out, addr = [HEAD], 0
    for line in lines:
        if line.endswith(":"):
            out.append(f"{line}\n")
        else:
            out.append(f"        /*{addr:04x}*/                   {line} ;\n")
            addr += 0x10
    return "".join(out)


# A K/V loop: a bounds-checked load (skipped on a boundary tile), one MMA, a rare fix-up that
# runs a second MMA, the back edge; before it a prologue loop without MMA, after it the epilogue.
KERNEL = listing(
    "MOV R1, c[0x0][0x28]",
    ".L_x_0:",
    "LDG.E R4, desc[UR4][R2.64]",           # prologue loop: Q load
    "IADD3 R2, R2, 0x4, RZ",
    "@P1 BRA `(.L_x_0)",
    ".L_x_1:",                              # the K/V loop
    "ISETP.GE.AND P2, PT, R5, R6, PT",
    "@P2 BRA `(.L_x_2)",                    # boundary tile: skip the load
    "LDG.E.128 R8, desc[UR4][R12.64]",
    "STS.128 [R13], R8",
    ".L_x_2:",
    "BAR.SYNC.DEFER_BLOCKING 0x0",
    "LDSM.16.M88.4 R16, [R14]",
    "HMMA.16816.F32 R20, R16, R18, R20",
    "FMNMX R24, R20, R21, !PT",
    "MUFU.EX2 R25, R24",
    "@!P3 BRA `(.L_x_3)",                   # rare: non-finite fix-up
    "FSEL R20, R20, RZ, P4",
    "FSEL R21, R21, RZ, P4",
    "HMMA.16816.F32 R20, R16, R18, R20",
    ".L_x_3:",
    "FFMA R26, R25, R27, R26",
    "IADD3 R5, R5, 0x1, RZ",
    "ISETP.NE.AND P0, PT, R5, R7, PT",
    "@P0 BRA `(.L_x_1)",
    "STG.E [R2.64], R26",
    "EXIT",
)


def test_parse_resolves_branch_targets():
    ins = sass.kernel_instructions(sass.parse(KERNEL))
    assert len(ins) == 23
    back = [i for i in ins if i.base == "BRA" and i.target is not None and i.target <= i.addr]
    assert [hex(i.target) for i in back] == ["0x10", "0x40"]
    assert ins[3].predicated and ins[3].op == "BRA" and not ins[4].predicated


def test_steady_loop_is_the_one_with_the_work():
    ins = sass.kernel_instructions(sass.parse(KERNEL))
    lp, work = sass.steady_loop(ins)
    assert work == "mma"
    assert (ins[lp.start].addr, ins[lp.end].addr) == (0x40, 0x140)


def test_counted_path_keeps_the_load_and_skips_the_fixup():
    row = sass.analyse(KERNEL, expect_mma=1)
    # ISETP, BRA, LDG.128, STS.128, BAR, LDSM, HMMA, FMNMX, MUFU, BRA, FFMA, IADD3, ISETP, BRA
    assert row["instructions"] == 14
    c = row["counts"]
    assert c["mma"] == 1 and c["ldg16"] == 1 and c["sts16"] == 1 and c["ldsm"] == 1
    assert "fp_other" in c and c["fp_other"] == 1  # FMNMX only: the two FSEL are the fix-up's
    assert row["non_mma_per_mma"] == 13.0
    assert row["global_bytes"] == 32 * 16
    assert row["ceiling_tflops"] == pytest.approx(sass.WARP_IPS * 4096 / 14 / 1e12, rel=1e-3)


def test_without_an_expected_mma_count_the_most_work_is_counted():
    row = sass.analyse(KERNEL)  # no cap: the fix-up's second MMA is on the most-work path
    assert row["mma"] == 2 and row["instructions"] == 17


def test_inner_loop_counts_trips_or_is_flagged():
    text = listing(
        ".L_x_0:",
        "HMMA.16816.F32 R20, R16, R18, R20",
        ".L_x_1:",
        "LDS R4, [R2]",
        "IADD3 R2, R2, 0x4, RZ",
        "@P1 BRA `(.L_x_1)",
        "@P0 BRA `(.L_x_0)",
        "EXIT",
    )
    once = sass.analyse(text)
    assert once["inner_loops"] == 1 and not once["trips_known"] and once["instructions"] == 5
    four = sass.analyse(text, trips=[4])
    assert four["trips_known"] and four["instructions"] == 2 + 4 * 3
    assert four["counts"]["lds4"] == 4


def test_ffma_kernel_and_streaming_figures():
    text = listing(
        ".L_x_0:",
        "LDG.E.64 R4, desc[UR4][R2.64]",
        "FFMA R6, R4, R5, R6",
        "FFMA R7, R4, R5, R7",
        "@P0 BRA `(.L_x_0)",
        "EXIT",
    )
    row = sass.analyse(text)
    assert row["work"] == "ffma" and row["mma"] == 0 and row["non_mma_per_mma"] is None
    assert row["bytes_per_instruction"] == 32 * 8 / 4
    assert row["ffma_share"] == 0.5


@pytest.mark.parametrize("op, cls", [
    ("HMMA.16816.F32", "mma"), ("LDG.E.U16", "ldg2"), ("LDG.E.128.CONSTANT", "ldg16"),
    ("LDGSTS.E.BYPASS.128", "ldgsts16"), ("LDSM.16.MT88.4", "ldsm"), ("LDS.64", "lds8"),
    ("STL.64", "local"), ("SHFL.BFLY", "shfl"), ("MUFU.EX2", "mufu"), ("DADD", "fp64"),
    ("F2FP.F16.F32.PACK_AB", "convert"), ("IMAD.WIDE.U32", "int_addr"), ("BAR.SYNC", "barrier"),
])
def test_classes(op, cls):
    assert sass.classify(op) == cls


def test_mark_loop():
    marked = sass.mark_loop(KERNEL, "0x0040-0x0140").splitlines()
    assert sum(line.startswith("> ") for line in marked) == 17


def countdown_loop(init, unroll=1):
    """A kernel whose steady loop holds an inner count-down loop as ptxas compiles a numba
    ``range`` of a compile-time count: counter set to ``init``, tested against 0 before each of
    its ``unroll`` adds (the middle tests leave the loop), back edge on a PLOP3 copy."""
    body = []
    for u in range(unroll):
        body += ["LDS R4, [R2]", "FFMA R6, R4, R5, R6",
                 "UISETP.NE.U32.AND UP0, UPT, UR20, URZ, UPT",
                 "UISETP.NE.AND.EX UP0, UPT, UR9, URZ, UPT, UP0",
                 "USEL UR8, URZ, 0xffffffff, !UP0",
                 "PLOP3.LUT P2, PT, PT, PT, UP0, 0x80, 0x0",
                 f"UIADD3 UR20, UP{u + 1}, UR8, UR20, URZ"]
        if u < unroll - 1:
            body.append("@!P2 BRA `(.L_x_9)")
    return listing(
        ".L_x_0:",
        "FFMA R7, R4, R5, R7",
        f"UMOV UR20, {init:#x}",
        "UMOV UR9, URZ",
        ".L_x_1:",
        *body,
        "@P2 BRA `(.L_x_1)",
        ".L_x_9:",
        "@P0 BRA `(.L_x_0)",
        "EXIT",
    )


@pytest.mark.parametrize("init, unroll, trips", [(15, 1, 16), (63, 1, 64), (15, 2, 8)])
def test_trip_count_read_from_a_countdown_counter(init, unroll, trips):
    text = countdown_loop(init, unroll)
    ins = sass.kernel_instructions(sass.parse(text))
    inner = min(sass.loops(ins), key=lambda lp: lp.end - lp.start)
    assert sass.infer_trips(ins, inner) == trips
    row = sass.analyse(text)
    assert row["trips_known"] and row["counts"]["ffma"] == 1 + trips * unroll


def test_unknown_counter_form_is_a_lower_bound():
    text = countdown_loop(15).replace("UMOV UR20, 0xf", "UIADD3 UR20, UR4, 0x3, URZ")
    ins = sass.kernel_instructions(sass.parse(text))
    inner = min(sass.loops(ins), key=lambda lp: lp.end - lp.start)
    assert sass.infer_trips(ins, inner) is None
    assert not sass.analyse(text)["trips_known"]


def countup_loop(init_ins, step, bound, op="VIADD"):
    """A kernel whose steady loop holds an inner count-up loop as ptxas compiles the SIMT
    forward's ``while off < BOUND: ...; off += STEP`` (a 32-bit offset): counter set before the
    loop, one add in the body, then ``ISETP.GE`` against the bound and ``@!P BRA`` back."""
    add = (f"VIADD R10, R10, {step:#x}" if op == "VIADD"
           else f"IADD3 R10, R10, {step:#x}, RZ")
    return listing(
        ".L_x_0:",
        "FFMA R7, R4, R5, R7",
        init_ins,
        ".L_x_1:",
        "LDS.128 R4, [R10+UR4]",
        "FFMA R6, R4, R5, R6",
        add,
        f"ISETP.GE.AND P1, PT, R10, {bound:#x}, PT",
        "@!P1 BRA `(.L_x_1)",
        "@P0 BRA `(.L_x_0)",
        "EXIT",
    )


@pytest.mark.parametrize("init_ins, step, bound, op, trips", [
    ("CS2R R10, SRZ", 0x10, 0x100, "VIADD", 16),
    ("IMAD.MOV.U32 R10, RZ, RZ, RZ", 0x4, 0x20, "VIADD", 8),
    ("MOV R10, 0x20", 0x10, 0x100, "IADD3", 14),
    ("MOV R10, RZ", 0x10, 0x108, "VIADD", 17),   # a last partial step still runs
])
def test_trip_count_read_from_a_countup_counter(init_ins, step, bound, op, trips):
    text = countup_loop(init_ins, step, bound, op)
    ins = sass.kernel_instructions(sass.parse(text))
    inner = min(sass.loops(ins), key=lambda lp: lp.end - lp.start)
    assert sass.infer_trips(ins, inner) == trips
    row = sass.analyse(text)
    assert row["trips_known"] and row["counts"]["ffma"] == 1 + trips


def test_countup_counter_without_a_known_start_is_a_lower_bound():
    text = countup_loop("IADD3 R10, R2, 0x3, RZ", 0x10, 0x100)
    ins = sass.kernel_instructions(sass.parse(text))
    inner = min(sass.loops(ins), key=lambda lp: lp.end - lp.start)
    assert sass.infer_trips(ins, inner) is None
    assert not sass.analyse(text)["trips_known"]
