"""The SASS tier: count what one steady-state loop iteration of a kernel issues on sm_90.

PTX says what Numba asked for; the machine code (SASS) says what the GPU will issue.  Without a GPU
the SASS can still be read: ptxas (``nvidia-cuda-nvcc`` wheel) assembles the PTX of a kernel
configuration into a cubin, nvdisasm (``nvidia-cuda-nvdisasm`` wheel) prints its instructions. This
module finds the kernel's steady-state loop in that listing, counts one iteration by instruction
class and turns the count into an issue-bound ceiling.

Contract of :func:`analyse` ``(listing, expect_mma=None, trips=None, work=None, share=WORK_SHARE,
streaming=False, ...)``:

* loops are back edges (:func:`loops`); the **work** is the tensor-core instructions
  (``HMMA``/``HGMMA``) if the kernel has any, else its ``FFMA``; the **steady-state loop**
  (:func:`steady_loop`) is the loop with the most MMAs in its own body, the shortest on a tie, or
  of a SIMT kernel the innermost loop that holds at least :data:`WORK_SHARE` of the work;
* one iteration (:func:`count_iteration`) is one path through the loop's forward branches: the most
  work (at most ``expect_mma``), then the most tile copies, then the most atomics, then the fewest
  instructions; an inner loop left in it counts ``trips`` times its body (the configuration's, else
  :func:`infer_trips`, else once: ``trips_known`` False, a lower bound);
* reported per warp and iteration: instructions by class (:func:`classify`), non-MMA instructions
  per MMA, the FFMA share, global bytes (32 lanes x each ``LDG``/``LDGSTS`` width) and bytes per
  instruction, the **issue bound** (``issue_tflops``; ``ceiling_tflops`` capped at
  :data:`MMA_SYNC_TFLOPS` for ``mma.sync``, :data:`WGMMA_TFLOPS` for ``wgmma``) the **shared-read
  bound** (``smem_tflops``, :func:`shared_read_bytes` at :data:`SMEM_BYTES_PER_CLK`) and a
  streaming kernel's ``ceiling_gbs``, on the :data:`H200`.

File: the H200's figures, the listing's parser and instruction classes, loops and the steady loop,
trip counts, the iteration's path, the bounds, :func:`analyse`, :func:`mark_loop` (``compile-check
--dump``).  How the loop and the path are chosen and why, and how to read the table:
docs/compile-tier.md#the-sass-tier-what-the-machine-code-issues.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
from typing import NamedTuple

#: H200 (SXM, 132 SMs) figures the ceilings use: 4 warp schedulers per SM, one instruction each
#: per clock, at the boost clock.  :data:`WARP_IPS` = 132 x 4 x 1.98e9 warp-instructions a second.
H200 = {"sms": 132, "schedulers": 4, "clock_hz": 1.98e9, "hbm_gbs": 4800.0,
        "copy_gbs": 4165.0}  # copy: device-to-device, measured on the H200 (pictures.ROOFLINE)
WARP_IPS = H200["sms"] * H200["schedulers"] * H200["clock_hz"]

#: what mma.sync (HMMA.16816, float16 in, float32 accumulate) can reach on an H200 whatever the
#: issue rate: about 2/3 of the 989 TFLOP/s dense wgmma peak (issue 20's figure, from the Triton
#: tutorial's mma.sync build); an issue-bound ceiling above it is reported as this bound
MMA_SYNC_TFLOPS = 660.0

#: the steady-state loop holds at least this share of the kernel's work instructions
WORK_SHARE = 0.75

#: bytes of shared memory an SM reads per clock (the shared-read bound's rate)
SMEM_BYTES_PER_CLK = 128

#: bytes one warp reads from shared memory per instruction of each ``ldsm`` class (``ldmatrix``
#: .x4 / .x2 / .x1: 16 B per lane and matrix row); an ``lds{w}`` reads ``32 w`` bytes
LDSM_BYTES = {"ldsm": 512, "ldsm_x2": 256, "ldsm_x1": 128}

#: floating-point operations of one warp-level MMA instruction
MMA_FLOP = {"HMMA.16816": 2 * 16 * 8 * 16, "HMMA.1688": 2 * 16 * 8 * 8,
            # sm_89's native e4m3 mma.sync.m16n8k32 (Hopper has none: ptxas turns it into
            # e4m3 -> float16 conversions and HMMA.16816, the fp8 forward's sm_90 build)
            "QMMA.16832": 2 * 16 * 8 * 32}

#: ... and the e4m3 peak of an H200's wgmma (``QGMMA``, twice the float16 rate): the cap of
#: an e4m3 warpgroup kernel's issue bound
WGMMA_FP8_TFLOPS = 1979.0

#: the dense float16 peak of an H200's tensor cores (wgmma): an issue-bound ceiling of an HGMMA
#: kernel above it is reported as this bound
WGMMA_TFLOPS = 989.0


def mma_flop(op):
    """Flops one warp's issue of a tensor-core instruction stands for: ``HMMA.16816`` 4096;
    ``HGMMA.64xNx16`` is issued by each of the warpgroup's 4 warps for a 64 x N x 16 product, so
    ``2 * 64 * N * 16 / 4`` per warp instruction."""
    if op.startswith(("HGMMA.", "QGMMA.")):   # m64nNk16 16-bit, m64nNk32 e4m3
        m, n, k = (int(x) for x in op.split(".")[1].split("x"))
        return 2 * m * n * k // 4
    return MMA_FLOP[".".join(op.split(".")[:2])]

_INS = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")
_PRED = re.compile(r"^@!?U?P[T\d]+\s+")
_FUNC = re.compile(r"^\.text\.(\S+):")


@dataclasses.dataclass
class Ins:
    addr: int
    text: str          # the instruction without its predicate
    op: str            # the opcode with its modifiers, e.g. ``LDG.E.U16``
    predicated: bool
    target: int | None = None  # branch target address
    pred: str = ""             # the guarding predicate as written, e.g. ``@!P1``

    @property
    def base(self):
        return self.op.split(".")[0]


def disassemble(cubin, nvdisasm):
    """The SASS listing of a cubin (``nvdisasm -c``: code sections only)."""
    proc = subprocess.run([nvdisasm, "-c", cubin], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvdisasm failed: {proc.stderr.strip()[-500:]}")
    return proc.stdout


def parse(listing):
    """``{function: [Ins]}`` from an nvdisasm listing, branch targets resolved to addresses."""
    funcs, labels, current, pending = {}, {}, None, []
    for line in listing.splitlines():
        stripped = line.strip()
        if m := _FUNC.match(stripped):
            current = m.group(1)
            funcs[current] = []
            labels[current] = {}
            continue
        if m := _LABEL.match(stripped):
            pending.append(m.group(1))
            continue
        m = _INS.match(line)
        if not m or current is None:
            continue
        addr, text = int(m.group(1), 16), m.group(2)
        for name in pending:
            labels[current][name] = addr
        pending = []
        body = _PRED.sub("", text)
        pred = text[:len(text) - len(body)].strip()
        if pred == "@!PT":  # never executes (ptxas's padding, e.g. before LDGSTS): a no-op
            body = "NOP"
        funcs[current].append(Ins(addr, body, body.split()[0] if body else "", body != text,
                                  pred=pred))
    for name, ins in funcs.items():
        for i in ins:
            if i.base in ("BRA", "BRX", "JMP", "CALL", "BSSY", "BREAK", "BPT") and \
                    (t := _TARGET.search(i.text)):
                i.target = labels[name].get(t.group(1))
    return funcs


def kernel_instructions(funcs):
    """The entry kernel's instructions (the longest function: internal helpers such as
    ``__cuda_sm20_div_s64`` are separate, small functions)."""
    return max(funcs.values(), key=len)


# -- classes ---------------------------------------------------------------------------------
def _width(op):
    """Bytes per lane of a load or store from its modifiers."""
    for mod, size in ((".128", 16), (".64", 8), (".U16", 2), (".S16", 2), (".U8", 1),
                      (".S8", 1)):
        if mod in op:
            return size
    return 4


def classify(op):
    """The class an instruction counts in (the column names of the SASS table)."""
    base = op.split(".")[0]
    if base in ("HMMA", "HGMMA", "IMMA", "DMMA", "BMMA", "QMMA", "QGMMA"):
        return "mma"
    if base == "FFMA":
        return "ffma"
    if base in ("FMUL", "FADD"):
        return "fmul_fadd"
    if base in ("FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FSWZADD"):
        return "fp_other"
    if base in ("HFMA2", "HADD2", "HMUL2", "HMNMX2", "HSETP2", "HSET2"):
        return "half2"
    if base == "MUFU":
        return "mufu"
    if base in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX"):
        return "fp64"
    if base in ("LDG", "LD"):
        return f"ldg{_width(op)}"
    if base == "LDGSTS":
        return f"ldgsts{_width(op)}"
    if base == "LDSM":  # ldmatrix .x4 (512 B per warp), .x2 (256 B), .x1 (128 B)
        return {"4": "ldsm", "2": "ldsm_x2"}.get(op.rsplit(".", 1)[-1], "ldsm_x1")
    if base == "LDS":
        return f"lds{_width(op)}"
    if base == "STS":
        return f"sts{_width(op)}"
    if base in ("STG", "ST", "RED", "ATOM", "ATOMG", "REDG"):
        return "stg_atom"
    if base in ("LDL", "STL"):
        return "local"
    if base == "SHFL":
        return "shfl"
    if base in ("BAR", "DEPBAR", "LDGDEPBAR", "ARRIVES", "SYNCS", "MEMBAR", "ERRBAR"):
        return "barrier"
    if base in ("BRA", "BRX", "JMP", "BSSY", "BSYNC", "WARPSYNC", "CALL", "RET", "EXIT",
                "BREAK", "NOP", "YIELD", "VOTE", "VOTEU", "BMOV"):
        return "branch"
    if base in ("F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "FRND"):
        return "convert"
    return "int_addr"


# -- loops -----------------------------------------------------------------------------------
@dataclasses.dataclass
class Loop:
    start: int  # index of the first instruction
    end: int    # index of the back-edge branch
    children: list = dataclasses.field(default_factory=list)

    def contains(self, other):
        return self.start <= other.start and other.end <= self.end and self != other


def loops(ins):
    """Every back edge as a :class:`Loop`, innermost first within each nest (sorted by size)."""
    index = {i.addr: n for n, i in enumerate(ins)}
    found = []
    for n, i in enumerate(ins):
        if i.base in ("BRA", "JMP") and i.target is not None and i.target <= i.addr:
            found.append(Loop(index[i.target], n))
    # merge back edges to one header (a loop with two latches): keep the outermost latch
    by_start = {}
    for lp in found:
        if lp.start not in by_start or lp.end > by_start[lp.start].end:
            by_start[lp.start] = lp
    found = sorted(by_start.values(), key=lambda lp: lp.end - lp.start)
    for lp in found:
        lp.children = [c for c in found if lp.contains(c)
                       and not any(lp.contains(m) and m.contains(c) for m in found)]
    return found


def _work_class(ins):
    return "mma" if any(classify(i.op) == "mma" for i in ins) else "ffma"


def is_work(cls, work):
    """Whether an instruction of class ``cls`` is ``work``: ``"mma"``, ``"ffma"``, or ``"ldg"``
    (global loads of any width, cp.async included: a streaming kernel such as decode)."""
    if work == "ldg":
        return cls.startswith("ldg")
    return cls == work


def steady_loop(ins, work=None, share=WORK_SHARE):
    """The innermost loop holding at least ``share`` of the kernel's work (``work``: see
    :func:`is_work`; by default MMAs if the kernel has any, else FFMAs)."""
    work = work or _work_class(ins)
    total = sum(is_work(classify(i.op), work) for i in ins)
    if total == 0:
        return None, work
    if work == "mma":
        # tensor-core kernels: the loop with the most MMAs in its own body (not in an inner
        # loop), the shortest on a tie, so that of a masked and an unmasked copy of the K/V
        # loop the unmasked one counts, and a k-step loop left inside does not
        def own(lp):
            inner = [(c.start, c.end) for c in lp.children]
            return sum(is_work(classify(ins[n].op), work) for n in range(lp.start, lp.end + 1)
                       if not any(a <= n <= b for a, b in inner))
        found = loops(ins)
        if found:
            lp = max(found, key=lambda lp: (own(lp), -(lp.end - lp.start)))
            if own(lp):
                return lp, work
    for lp in loops(ins):  # innermost first
        inside = sum(is_work(classify(i.op), work) for i in ins[lp.start:lp.end + 1])
        if inside >= share * total:
            return lp, work
    return None, work


# -- trip counts ----------------------------------------------------------------------------
_IMM_WRITE = re.compile(r"^(?:U?MOV|IMAD\.MOV\.U32)\s+(U?R\d+),\s*(?:U?RZ,\s*U?RZ,\s*)?"
                        r"(0x[0-9a-f]+|\d+)$")


def _operands(i):
    """The comma-separated operands of an instruction (destination first)."""
    rest = i.text[len(i.op):].strip()
    return [x.strip() for x in rest.split(",")] if rest else []


def infer_trips(ins, lp):
    """The trip count of a loop of the form ptxas gives a counted ``range`` loop, or None.

    Recognised form (a 64-bit count-down counter, as numba's ``range`` over a compile-time
    count compiles): the back edge ``@P BRA`` where ``P`` is (a ``PLOP3`` copy of)
    ``(U)ISETP.NE.U32.AND P, PT, C, RZ`` (with its ``.EX`` high half) testing the counter ``C``
    before the one add that updates it in the body, and ``C`` set by a move of an immediate
    before the loop: the body runs ``C + 1`` times (``C`` if the test follows the add).  A body
    unrolled ``k`` times holds ``k`` test-and-add pairs (the middle tests leave the loop): it
    runs ``(C + 1) / k`` times when that divides.  Any other form is unknown (None)."""
    latch = ins[lp.end]
    if latch.pred.startswith("@!"):
        return _count_up_trips(ins, lp, latch.pred[2:])
    if not latch.pred:
        return None
    want = latch.pred[1:]
    test_at = None
    for n in range(lp.end - 1, lp.start - 1, -1):
        ops = _operands(ins[n])
        if not ops or ops[0] != want:
            continue
        if ins[n].op == "PLOP3.LUT" and ops[1:4] == ["PT", "PT", "PT"] and ops[5:] == ["0x80",
                                                                                        "0x0"]:
            want = ops[4]  # P = copy of another predicate
            continue
        if ins[n].base in ("ISETP", "UISETP") and ".EX" in ins[n].op:
            continue       # the high half of a 64-bit compare
        if ins[n].base in ("ISETP", "UISETP") and ins[n].op.startswith(("ISETP.NE.U32.AND",
                                                                        "UISETP.NE.U32.AND")) \
                and len(ops) >= 4 and ops[3] in ("RZ", "URZ"):
            test_at, counter = n, ops[2]
        break
    if test_at is None:
        return None
    writes = [n for n in range(lp.start, lp.end + 1)
              if _operands(ins[n])[:1] == [counter] and ins[n].base in ("IADD3", "UIADD3",
                                                                        "IMAD", "VIADD")]
    others = [n for n in range(lp.start, lp.end + 1) if _operands(ins[n])[:1] == [counter]
              and n not in writes]
    if not writes or others:
        return None
    for n in range(lp.start - 1, max(-1, lp.start - 400), -1):
        ops = _operands(ins[n])
        if ops[:1] != [counter]:
            continue
        m = _IMM_WRITE.match(ins[n].text)
        if not m or ins[n].predicated:
            return None
        init = int(m.group(2), 0)
        if len(writes) == 1:
            return init + 1 if test_at < writes[0] else init
        # unrolled by k: k tests and adds per trip (the middle tests leave the loop early)
        runs = init + 1
        return runs // len(writes) if runs % len(writes) == 0 else None
    return None


def _init_value(ins, lp, counter):
    """The immediate ``counter`` is set to before loop ``lp`` (a move of an immediate, or
    ``CS2R counter, SRZ``: zero), or None."""
    for n in range(lp.start - 1, max(-1, lp.start - 400), -1):
        i = ins[n]
        ops = _operands(i)
        if i.op == "CS2R" and ops[1:] == ["SRZ"] and counter in (ops[0], _next_reg(ops[0])):
            return None if i.predicated else 0
        if ops[:1] != [counter]:
            continue
        if i.predicated:
            return None
        if i.op in ("MOV", "IMAD.MOV.U32") and ops[-1] == "RZ" and set(ops[1:]) == {"RZ"}:
            return 0
        m = _IMM_WRITE.match(i.text)
        return int(m.group(2), 0) if m else None
    return None


def _next_reg(reg):
    """``R11`` for ``R10`` (the second register a 64-bit ``CS2R`` writes)."""
    m = re.fullmatch(r"(U?R)(\d+)", reg)
    return f"{m.group(1)}{int(m.group(2)) + 1}" if m else ""


def _count_up_trips(ins, lp, want):
    """The second recognised form (a ``while`` loop over a 32-bit offset, as the SIMT forward's
    stages write them): the back edge ``@!P BRA`` where ``P`` is ``ISETP.GE[.U32].AND P, PT, C,
    BOUND`` testing the counter ``C`` after the one add ``C += STEP`` (``VIADD`` / ``IADD3``,
    immediates) in the body, ``C`` set to an immediate ``INIT`` before the loop: the body runs
    ``ceil((BOUND - INIT) / STEP)`` times.  None for any other form."""
    test_at = None
    for n in range(lp.end - 1, lp.start - 1, -1):
        ops = _operands(ins[n])
        if not ops or ops[0] != want:
            continue
        if ins[n].op in ("ISETP.GE.AND", "ISETP.GE.U32.AND") and len(ops) >= 4 \
                and ops[1] == "PT" and re.fullmatch(r"0x[0-9a-f]+|\d+", ops[3]):
            test_at, counter, bound = n, ops[2], int(ops[3], 0)
        break
    if test_at is None:
        return None
    writes = [n for n in range(lp.start, lp.end + 1) if _operands(ins[n])[:1] == [counter]]
    if len(writes) != 1 or writes[0] > test_at:
        return None
    w = ins[writes[0]]
    ops = _operands(w)
    if w.predicated or ops[1:2] != [counter]:
        return None
    if w.base == "VIADD" and len(ops) == 3:
        step = ops[2]
    elif w.base == "IADD3" and len(ops) == 4 and ops[3] == "RZ":
        step = ops[2]
    else:
        return None
    if not re.fullmatch(r"0x[0-9a-f]+|\d+", step) or int(step, 0) <= 0:
        return None
    init = _init_value(ins, lp, counter)
    if init is None or init >= bound:
        return None
    return -(-(bound - init) // int(step, 0))


# -- the counted path ------------------------------------------------------------------------
def _blocks(ins, lp):
    """Straight-line blocks of the loop body with inner loops collapsed to one node each:
    ``[(first, last, inner_loop_or_None)]`` in address order."""
    inner = sorted(lp.children, key=lambda c: c.start)
    leaders = {lp.start, lp.end + 1}
    for c in inner:
        leaders |= {c.start, c.end + 1}
    index = {i.addr: n for n, i in enumerate(ins)}
    for n in range(lp.start, lp.end + 1):
        i = ins[n]
        if any(c.start <= n <= c.end for c in inner):
            continue
        if i.base in ("BRA", "JMP", "EXIT", "RET", "BRX"):
            leaders.add(n + 1)
            if i.target is not None and i.target in index:
                leaders.add(index[i.target])
    cuts = sorted(x for x in leaders if lp.start <= x <= lp.end + 1)
    blocks = []
    for a, b in zip(cuts, cuts[1:]):
        node = next((c for c in inner if c.start == a), None)
        if any(c.start < a <= c.end for c in inner):
            continue  # inside an inner loop: its node stands for it
        if node is not None:
            blocks.append((node.start, node.end, node))
            if b - 1 > node.end:
                blocks.append((node.end + 1, b - 1, None))
        else:
            blocks.append((a, b - 1, None))
    return blocks


class _Path(NamedTuple):
    """A path from the loop body's first block (:func:`count_iteration`): its work, loads,
    atomics and minus its instruction count, its per-class counts and the blocks of inner
    loops on it."""

    work: int
    loads: int
    atomics: int
    neg_instructions: int
    counts: dict
    inner: tuple

    @property
    def rank(self):
        """Most work, then most loads, then most atomics, then fewest instructions."""
        return self.work, self.loads, self.atomics, self.neg_instructions


def count_iteration(ins, lp, work, expect_mma=None, trips=None):
    """Per-class counts of one iteration of ``lp`` along the counted path (see the module
    docstring); returns ``(counts, inner_loops, trips_known)``: the inner loops on that path and
    whether every one of them had its trip count given."""
    blocks = _blocks(ins, lp)
    pos = {b[0]: n for n, b in enumerate(blocks)}
    index = {i.addr: n for n, i in enumerate(ins)}
    trips = list(trips or [])
    inner_nodes = [b[2] for b in blocks if b[2] is not None]
    inferred = [infer_trips(ins, node) for node in inner_nodes]

    def weight(block):
        first, last, node = block
        counts = {}
        if node is None:
            for i in ins[first:last + 1]:
                c = classify(i.op)
                counts[c] = counts.get(c, 0) + 1
            return counts
        k = inner_nodes.index(node)
        t = trips[k] if k < len(trips) else (inferred[k] or 1)
        body, _, _ = count_iteration(ins, node, work, None, [])
        for c in set(body):  # the inner loop's own counted path, ``t`` times
            counts[c] = counts.get(c, 0) + body[c] * t
        return counts

    def successors(n):
        first, last, node = blocks[n]
        if node is not None:
            return [n + 1] if n + 1 < len(blocks) else []
        term = ins[last]
        out = []
        if term.base in ("EXIT", "RET") and not term.predicated:
            return []
        if term.base in ("BRA", "JMP") and term.target is not None:
            tgt = index.get(term.target)
            if n == len(blocks) - 1 and last == lp.end:
                return []  # the back edge: the end of the iteration
            if tgt in pos and tgt > first:
                out.append(pos[tgt])
            # BRA.DIV is taken only by a diverged warp (to an out-of-line fallback before warp
            # shuffles): conditional, like a predicated branch
            if not term.predicated and ".DIV" not in term.op:
                return out
        if n + 1 < len(blocks):
            out.append(n + 1)
        return out

    # a kernel that copies its tiles with cp.async does its steady-state loads that way (a
    # plain LDG is then a fix-up's re-read); otherwise its global loads are the copies
    copy = "ldgsts" if any(classify(i.op).startswith("ldgsts")
                           for i in ins[lp.start:lp.end + 1]) else "ldg"

    def loads(w):
        return sum(v for c, v in w.items()
                   if c.startswith(copy) and (copy == "ldgsts" or not c.startswith("ldgsts")))

    def work_of(w):
        return sum(v for c, v in w.items() if is_work(c, work))

    def rest_of(w):  # the tile's atomics (dQ's): a masked step may branch past masked rows'
        return w.get("stg_atom", 0)

    # most work, then most loads, then most atomics, then fewest
    # instructions: a path through the DAG, with states (block, mma so far) so that the cap on
    # MMAs holds
    cap = expect_mma
    best = {}  # (block, mma) -> the best _Path to it
    w0 = weight(blocks[0])
    start_m = w0.get("mma", 0)
    def inner_of(n):
        return (n,) if blocks[n][2] is not None else ()

    best[(0, start_m)] = _Path(work_of(w0), loads(w0), rest_of(w0), -sum(w0.values()), w0,
                               inner_of(0))
    for n in range(len(blocks)):
        for (bn, m), path in sorted(((k, v) for k, v in best.items() if k[0] == n),
                                    key=lambda kv: kv[0]):
            for s in successors(bn):
                ws = weight(blocks[s])
                m2 = m + ws.get("mma", 0)
                if cap is not None and m2 > cap:
                    continue
                merged = dict(path.counts)
                for c, v in ws.items():
                    merged[c] = merged.get(c, 0) + v
                cand = _Path(path.work + work_of(ws), path.loads + loads(ws),
                             path.atomics + rest_of(ws), path.neg_instructions - sum(ws.values()),
                             merged, path.inner + inner_of(s))
                key = (s, m2)
                if key not in best or cand.rank > best[key].rank:
                    best[key] = cand
    last = len(blocks) - 1
    ends = [v for (bn, _), v in best.items() if bn == last]
    if not ends:
        ends = list(best.values())
    chosen = max(ends, key=lambda v: v.rank)
    on_path = [inner_nodes.index(blocks[n][2]) for n in chosen.inner]
    return chosen.counts, len(on_path), all(k < len(trips) or inferred[k] for k in on_path)


def shared_read_bytes(counts):
    """Bytes one warp reads from shared memory for ``counts`` (the classes of
    :func:`classify`): :data:`LDSM_BYTES` per ``ldmatrix``, ``32 w`` per ``lds{w}``."""
    out = sum(LDSM_BYTES[c] * v for c, v in counts.items() if c in LDSM_BYTES)
    return out + sum(32 * int(c[3:]) * v for c, v in counts.items()
                     if c.startswith("lds") and c[3:].isdigit())


def smem_bound_tflops(flop, smem_bytes):
    """The shared-read bound (TFLOP/s on an H200) of ``flop`` per ``smem_bytes`` read."""
    if not smem_bytes:
        return None
    return H200["sms"] * H200["clock_hz"] * SMEM_BYTES_PER_CLK * flop / smem_bytes / 1e12


def analyse(listing, expect_mma=None, trips=None, work=None, share=WORK_SHARE, streaming=False,
            mma_kind="HMMA.16816"):
    """The SASS row of one kernel: per-iteration counts and the derived figures.  The keyword
    arguments are a configuration's ``"sass"`` hints: ``expect_mma`` (MMAs one iteration
    issues), ``trips`` (inner-loop trip counts, innermost loops in address order), ``work``
    (what the steady-state loop does: ``"ldg"`` for a streaming kernel) and ``share`` (of that
    work the loop holds at least: a kernel with several specialised copies of its loop, such as
    decode's contiguous and paged paths, holds less than :data:`WORK_SHARE` in each) and
    ``streaming`` (the kernel is bound by the bytes it moves, not its flops: decode)."""
    ins = kernel_instructions(parse(listing))
    lp, work = steady_loop(ins, work, share)
    row = {"kernel_instructions": len(ins), "loop": None, "streaming": streaming}
    if lp is None:
        return row
    counts, inner, known = count_iteration(ins, lp, work, expect_mma, trips)
    total = sum(counts.values())
    mma = counts.get("mma", 0)
    ldg_bytes = 32 * sum(int(c[3:]) * v for c, v in counts.items() if c.startswith("ldg")
                         and c[3:].isdigit())
    ldg_bytes += 32 * sum(int(c[6:]) * v for c, v in counts.items() if c.startswith("ldgsts"))
    row.update(
        loop=f"{ins[lp.start].addr:#06x}-{ins[lp.end].addr:#06x}", work=work,
        instructions=total, counts=dict(sorted(counts.items())), mma=mma,
        inner_loops=inner, trips_known=known,
        non_mma_per_mma=round((total - mma) / mma, 2) if mma else None,
        ffma_share=round(counts.get("ffma", 0) / total, 3) if total else 0.0,
        global_bytes=ldg_bytes,
        bytes_per_instruction=round(ldg_bytes / total, 2) if total else 0.0,
    )
    ops = [i.op for i in ins[lp.start:lp.end + 1] if classify(i.op) == "mma"]
    if ops:  # the loop's own tensor-core instruction (HMMA.16816, HGMMA.64xNx16, ...)
        mma_kind = ops[0]
    # flop of a loop of mixed shapes (the wgmma forward's m64n128k16 and m64n64k16): the mean
    # of the loop body's own tensor-core instructions
    per_mma = sum(map(mma_flop, ops)) / len(ops) if ops else mma_flop(mma_kind)
    flop = per_mma * mma if mma else 64 * counts.get("ffma", 0)
    smem = shared_read_bytes(counts)
    row["shared_bytes"] = smem
    bound = smem_bound_tflops(flop, smem)
    row["smem_tflops"] = None if bound is None else round(bound, 1)
    issue = WARP_IPS * flop / total / 1e12
    row["issue_tflops"] = round(issue, 1)
    if mma:
        # (QMMA, sm_89's e4m3: no H200 figure caps it, the issue bound is the ceiling)
        cap = (WGMMA_TFLOPS if mma_kind.startswith("HGMMA") else
               WGMMA_FP8_TFLOPS if mma_kind.startswith("QGMMA") else
               float("inf") if mma_kind.startswith("QMMA") else MMA_SYNC_TFLOPS)
        row["ceiling_tflops"] = round(min(issue, cap), 1)
        row["bound"] = "issue" if issue < cap else ("wgmma" if cap in (WGMMA_TFLOPS,
                                                                         WGMMA_FP8_TFLOPS) else
                                                     "mma.sync")
    else:
        row["ceiling_tflops"] = round(issue, 1)
    row["ceiling_gbs"] = round(WARP_IPS * row["bytes_per_instruction"] / 1e9, 1)
    return row


def mark_loop(listing, loop):
    """The listing with the instructions of ``loop`` (``"0x3990-0xbe80"``) marked ``>``."""
    if not loop:
        return listing
    lo, hi = (int(x, 16) for x in loop.split("-"))
    out = []
    for line in listing.splitlines():
        m = _INS.match(line)
        inside = m is not None and lo <= int(m.group(1), 16) <= hi
        out.append(("> " if inside else "  ") + line)
    return "\n".join(out)
