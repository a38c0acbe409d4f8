"""How a kernel's memory accesses behave, counted in the simulator (issue 63).

The SASS tier (:mod:`numba_flash.tools.sass`) counts the instructions a kernel issues; what it
cannot see is how each memory instruction behaves: how many 32-byte sectors a warp's global load
touches, how many shared-memory wavefronts (bank conflicts) a warp's ``ldmatrix``, ``LDS``,
``STS`` or ``cp.async`` costs.  The simulator runs every thread of a kernel with its real
indices, so this module records every access (the recording mode of
:mod:`numba_flash.kernels.ptx.record`: lane, site, occurrence, byte address), groups the lanes
of one warp that ran the same site for the same time into one **request**, and counts each
request with the hardware's rules:

* **global** (a load, a store, ``cp.async``'s read, an atomic): the 32-byte **sectors** and
  128-byte **lines** the request's bytes fall in.  ``ideal``: the sectors its distinct bytes
  would need if packed; a row of 32 float32 is 4 sectors a request, a column of a row-major
  float32 matrix 32 (one per lane);
* **shared** (a load, a store, ``ldmatrix``, ``cp.async``'s write, a ``wgmma`` operand): 32 banks
  of 4 bytes; the lanes are served in **phases** of 128 bytes (all 32 lanes for accesses of up
  to 4 bytes, 16 for 8 bytes, 8 for 16 bytes: ``ldmatrix``'s 8 rows of 16 bytes, ``lds16``,
  ``cp.async``; a ``wgmma`` operand's 8 x 16-byte core matrices); a phase takes as many
  **wavefronts** as the most *different* 4-byte words any one bank holds (a word read by
  several lanes is a broadcast).  ``ways``: the worst phase's wavefronts over its ideal (1: no
  conflict); ``conflicts``: wavefronts beyond the ideal, as Nsight Compute counts them.

:func:`record` runs any call (``lambda: numba_flash.forward(q, k, v, kernel="mma")``) with
recording on and returns its result and a :class:`Profile`: per launch and per **site** (the
call chain inside the kernel: ``flash_forward_mma+23 > copy_tile+2 > copy_column+25``, each frame
a function and its line offset from the function's ``def``) the requests, bytes, sectors, lines,
wavefronts and conflict ways, and totals.  ``numba-flash profile OP`` prints the table for one
call of a public op on a small problem (:func:`main`); ``--tiles gpu`` runs the GPU build's tiles
in the simulator (:func:`gpu_tiles`), the layout the GPU's accesses have.  The teaching kernels
of docs/memory-access.md (:func:`demo_kernel`: a row and a column read, a shared tile read by
columns with and without padding, ``ldmatrix`` on a plain, padded and swizzled tile) are the
known answers the tests check.

Nsight Compute's names for the same quantities (:data:`NCU_METRICS`):
``l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum`` over ``l1tex__t_requests_..._ld.sum``
(sectors per request), ``l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum`` and
``l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum`` (and ``_st``); per source line the
Source page's "L2 Theoretical Sectors Global (Ideal)" and "L1 Wavefronts Shared (Ideal)"
columns.  :meth:`Profile.by_line` sums the simulator's figures per innermost source line, the
rows a comparison with ncu's source page lines up with (unmeasured here: no GPU).

What the model leaves out: caches (a sector is counted each time a request touches it, as
``l1tex__t_sectors`` counts them; L1/L2 hits are ncu's other metrics), the order and timing of
requests, and the GPU's scheduling; a site that lanes reach a different number of times groups
their n-th visits together.  Local arrays (``cuda.local.array``: registers) are not memory here.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

import numba_flash  # noqa: F401  (chooses the backend before numba.cuda is imported)
from numba import cuda, float32, types  # noqa: E402  (the teaching kernels' module globals)

from numba_flash.backend import on_simulator
from numba_flash.kernels.ptx import record as _record

SECTOR = 32        #: bytes of a global-memory sector
LINE = 128         #: bytes of a cache line (one wavefront of a global request touches one)
BANKS = 32         #: shared-memory banks
WORD = 4           #: bytes a bank serves per wavefront
PHASE_BYTES = BANKS * WORD   #: bytes a shared-memory phase (one wavefront) can serve

#: the operations, as the table names them: what the kernel's line does, and its instruction
OPS = {"ld": "load", "st": "store", "ldgsts": "cp.async", "ldsm": "ldmatrix", "red": "red.add",
       "atom": "atomic", "wgmma": "wgmma operand"}

#: Nsight Compute metrics (sm_80 / sm_90 names) of each ``(space, op)``: ``(requests, sectors
#: or wavefronts, ideal or conflicts)``; ``cp.async`` (``LDGSTS``) bypasses L1 (``.cg``)
NCU_METRICS = {
    ("global", "ld"): ("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum",
                       "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"),
    ("global", "st"): ("l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
                       "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"),
    ("global", "red"): ("l1tex__t_requests_pipe_lsu_mem_global_op_red.sum",
                        "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum"),
    ("global", "atom"): ("l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum",
                         "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum"),
    ("global", "ldgsts"): ("l1tex__t_requests_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum",
                           "l1tex__t_sectors_pipe_lsu_mem_global_op_ldgsts_cache_bypass.sum"),
    ("shared", "ld"): ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
                       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("shared", "ldsm"): ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum",
                         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("shared", "st"): ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum",
                       "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("shared", "atom"): ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_atom.sum",
                         "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_atom.sum"),
    ("shared", "ldgsts"): ("l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ldgsts.sum",
                           "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ldgsts.sum"),
    ("shared", "wgmma"): ("(no per-operand counter: HGMMA reads shared memory outside the LSU)",
                          ""),
}


# ------------------------------------------------------------------------------------------
# the hardware's rules, one request at a time
# ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GlobalCount:
    """One global request: bytes the lanes asked for (``bytes``; ``distinct`` without repeats),
    the sectors and lines touched, and the sectors the distinct bytes need at least."""

    bytes: int
    distinct: int
    sectors: int
    lines: int
    ideal: int


def _spans(accesses):
    """The union of byte ranges ``(addr, nbytes)``, as sorted disjoint ``[start, end)``."""
    out = []
    for a, n in sorted((int(a), int(n)) for a, n in accesses if n > 0):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n)
        else:
            out.append([a, a + n])
    return out


def global_counts(accesses):
    """:class:`GlobalCount` of one warp's global request, ``accesses`` its lanes' ``(byte
    address, bytes)``: a row of 32 float32 (``[(base + 4 i, 4) for i in range(32)]``) is 4
    sectors and 1 line; a column of a 32-wide float32 matrix 32 and 32."""
    spans = _spans(accesses)
    sectors, lines = set(), set()
    for a, e in spans:
        sectors.update(range(a // SECTOR, (e - 1) // SECTOR + 1))
        lines.update(range(a // LINE, (e - 1) // LINE + 1))
    distinct = sum(e - a for a, e in spans)
    return GlobalCount(sum(int(n) for _, n in accesses), distinct, len(sectors), len(lines),
                       -(-distinct // SECTOR))


def lanes_per_phase(width):
    """Lanes a shared-memory phase serves for accesses of ``width`` bytes a lane: 32 up to 4
    bytes, 16 for 8, 8 for 16 (a phase moves at most 128 bytes)."""
    return BANKS if width <= WORD else max(1, PHASE_BYTES // width)


def bank_words(accesses):
    """``{bank: set of 4-byte word addresses}`` the byte ranges ``(addr, nbytes)`` touch."""
    banks = defaultdict(set)
    for a, n in accesses:
        for w in range(int(a) // WORD, (int(a) + max(int(n), 1) - 1) // WORD + 1):
            banks[w % BANKS].add(w)
    return banks


def phase_wavefronts(accesses):
    """Wavefronts one phase takes: the most different words one bank holds (0 if empty)."""
    return max((len(s) for s in bank_words(accesses).values()), default=0)


@dataclass(frozen=True)
class SharedCount:
    """One shared request: ``bytes`` asked for, ``wavefronts`` it takes, ``ideal`` (one a
    phase that holds an access: a phase never moves more than 128 bytes), ``ways`` (the worst
    phase's wavefronts) and ``phases`` (the wavefronts of each)."""

    bytes: int
    wavefronts: int
    ideal: int
    ways: int
    phases: tuple

    @property
    def conflicts(self):
        return self.wavefronts - self.ideal


def shared_counts(lane_accesses, width=None):
    """:class:`SharedCount` of one warp's shared request, ``lane_accesses`` its lanes'
    ``(lane, byte address, bytes)`` and ``width`` the bytes a lane's instruction moves (default:
    the largest access): phases of :func:`lanes_per_phase` lanes (``lane // per``).  A column
    of a ``[32][32]`` float32 tile: 32 wavefronts, ``ways`` 32; of a ``[32][33]`` one: 1."""
    width = width or max((int(n) for _, _, n in lane_accesses), default=WORD)
    per = lanes_per_phase(width)
    phases = defaultdict(list)
    for lane, a, n in lane_accesses:
        phases[int(lane) // per].append((a, n))
    waves = tuple(phase_wavefronts(acc) for _, acc in sorted(phases.items()))
    return SharedCount(sum(int(n) for _, _, n in lane_accesses), sum(waves),
                       sum(1 for w in waves if w), max(waves, default=0), waves)


def chunk_counts(chunks, phases):
    """:class:`SharedCount` of a request given as byte ranges ``chunks`` served in ``phases``
    (lists of chunk indices, each one 128-byte access: a ``wgmma`` operand's core matrices)."""
    waves = tuple(phase_wavefronts([chunks[i] for i in ph]) for ph in phases)
    return SharedCount(sum(n for _, n in chunks), sum(waves), sum(1 for w in waves if w),
                       max(waves, default=0), waves)


# ------------------------------------------------------------------------------------------
# sites
# ------------------------------------------------------------------------------------------
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(numba_flash.__file__)))


def _short_path(filename):
    path = os.path.abspath(filename)
    if path.startswith(_ROOT + os.sep):
        return os.path.relpath(path, _ROOT)
    return os.path.basename(path)


def site_label(site, lines=False):
    """A site (:data:`~numba_flash.kernels.ptx.record.Access`'s ``site``, innermost frame first)
    as text, outermost first: ``kernel+23 > copy_tile+2 > copy_column+25`` (a function and the
    line's offset from its ``def``: stable while the function is unchanged), or with ``lines``
    the files' lines (``numba_flash/kernels/forward/mma.py:448 > ...``: Nsight Compute's source
    view)."""
    if lines:
        parts = [f"{_short_path(code.co_filename)}:{line}" for code, line in reversed(site)]
    else:
        parts = [f"{code.co_name}+{line - code.co_firstlineno}" for code, line in reversed(site)]
    return " > ".join(parts) or "?"


# ------------------------------------------------------------------------------------------
# the profile
# ------------------------------------------------------------------------------------------
@dataclass
class SiteStats:
    """One site of one launch: the requests of every warp that ran it, summed.

    ``requests``: warp requests (instructions a warp issued); ``lanes``: lane accesses;
    ``bytes``: bytes the lanes asked for; global: ``sectors``, ``lines``, ``ideal`` (sectors);
    shared: ``wavefronts``, ``ideal`` (wavefronts), ``ways`` (the worst request's)."""

    launch: int
    kernel: str
    site: tuple
    array: str
    op: str
    space: str
    width: int = 0
    requests: int = 0
    lanes: int = 0
    bytes: int = 0
    distinct: int = 0
    sectors: int = 0
    lines: int = 0
    ideal: int = 0
    wavefronts: int = 0
    ways: int = 0
    example: tuple = ()   # lanes ``(lane, addr, nbytes)`` of the first block's first warp's
    #                       first request (the pictures)

    def label(self, lines=False):
        return site_label(self.site, lines)

    @property
    def conflicts(self):
        return self.wavefronts - self.ideal if self.space == "shared" else 0

    def per_request(self, name):
        return getattr(self, name) / self.requests if self.requests else 0.0


@dataclass
class LaunchProfile:
    """One launch: its :class:`~numba_flash.kernels.ptx.record.Launch` and its sites."""

    launch: object
    sites: list = field(default_factory=list)

    @property
    def name(self):
        return self.launch.name

    @property
    def blocks(self):
        return max(1, math.prod(self.launch.grid or (1,)))

    def total(self, space, name):
        return sum(getattr(s, name) for s in self.sites if s.space == space)

    def find(self, array=None, op=None, space=None, contains=None):
        """The sites that match every given field (``contains``: text of the label)."""
        return [s for s in self.sites
                if (array is None or s.array == array) and (op is None or s.op == op)
                and (space is None or s.space == space)
                and (contains is None or contains in s.label())]


class Profile:
    """What :func:`record` saw: :attr:`launches`, one :class:`LaunchProfile` each."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.launches = [LaunchProfile(ln) for ln in recorder.launches]
        _analyse(recorder, self.launches)

    def launch(self, name=None):
        """The (first) launch of kernel ``name`` (default: the first launch)."""
        for lp in self.launches:
            if name is None or lp.name == name:
                return lp
        raise KeyError(f"no launch of {name!r}; recorded: {[lp.name for lp in self.launches]}")

    @property
    def sites(self):
        return [s for lp in self.launches for s in lp.sites]

    def by_line(self, launch=None):
        """``{(file, line, space, op): {"requests", "sectors", "ideal", "wavefronts"}}`` summed
        per innermost source line (Nsight Compute's source view: an inlined device function's
        line, whatever called it)."""
        out = {}
        for s in (self.launch(launch).sites if launch else self.sites):
            code, line = s.site[0] if s.site else (None, 0)
            key = (_short_path(code.co_filename) if code else "?", line, s.space, s.op)
            row = out.setdefault(key, {"requests": 0, "sectors": 0, "ideal": 0,
                                       "wavefronts": 0})
            for k in row:
                row[k] += getattr(s, k)
        return out

    def table(self, lines=False, markdown=False, launch=None):
        return render(self, lines=lines, markdown=markdown, launch=launch)

    def ncu_table(self, launch=None):
        """The comparison with Nsight Compute, per innermost source line (:meth:`by_line`), as
        Markdown: each line's metrics (:data:`NCU_METRICS`), the simulator's figure and the
        measured one, "unmeasured" until an ncu report fills it (``bench/gpu_check.py``'s
        ``ncu`` part exports the Source page per SASS line; summed per Python line they go in
        the last column, goal: within 10%)."""
        out = ["| source line | space | op | ncu metric | simulator | ncu |",
               "|---|---|---|---|---|---|"]
        for (path, line, space, op), row in sorted(self.by_line(launch).items()):
            names = NCU_METRICS.get((space, op), ("?", "?"))
            if space == "global":
                pairs = [(names[0], row["requests"]), (names[1], row["sectors"])]
            else:
                pairs = [(names[0], row["wavefronts"]),
                         (names[1], row["wavefronts"] - row["ideal"])]
            for metric, value in pairs:
                if metric:
                    out.append(f"| {path}:{line} | {space} | {OPS.get(op, op)} | `{metric}` | "
                               f"{value} | unmeasured |")
        return "\n".join(out) + "\n"


def _analyse(recorder, launches):
    """Group the recorded accesses into warp requests and count them into sites."""
    groups = defaultdict(list)
    for a in recorder.accesses:
        key = (a.launch, a.block, a.thread // 32, a.site, a.array, a.op, a.space, a.occ)
        groups[key].append((a.thread % 32, a.addr, a.nbytes, a.width))
    sites, first = {}, {}
    for (li, block, warp, site, array, op, space, occ), lanes in groups.items():
        width = max(w for *_, w in lanes)
        key = (li, site, array, op, space)
        st = sites.get(key)
        if st is None:
            st = sites[key] = SiteStats(li, launches[li].name, site, array, op, space, width)
        if key not in first or (block, warp, occ) < first[key]:   # the example: the first
            first[key] = (block, warp, occ)                        # warp's first request
            st.example = tuple((ln, a, n) for ln, a, n, _ in sorted(lanes))
        st.requests += 1
        st.lanes += len(lanes)
        if space == "global":
            c = global_counts([(a, n) for _, a, n, _ in lanes])
            st.bytes += c.bytes
            st.distinct += c.distinct
            st.sectors += c.sectors
            st.lines += c.lines
            st.ideal += c.ideal
        else:
            c = shared_counts([(ln, a, n) for ln, a, n, _ in lanes], width)
            st.bytes += c.bytes
            st.wavefronts += c.wavefronts
            st.ideal += c.ideal
            st.ways = max(st.ways, c.ways)
    for r in recorder.requests:
        c = chunk_counts(r.chunks, r.phases)
        st = sites.get((r.launch, r.site, r.array, r.op, r.space))
        if st is None:
            st = sites[(r.launch, r.site, r.array, r.op, r.space)] = SiteStats(
                r.launch, launches[r.launch].name, r.site, r.array, r.op, r.space, 16)
        st.requests += 1
        st.lanes += len(r.chunks)
        st.bytes += c.bytes
        st.wavefronts += c.wavefronts
        st.ideal += c.ideal
        st.ways = max(st.ways, c.ways)
    order = {"global": 0, "shared": 1}
    for st in sites.values():
        launches[st.launch].sites.append(st)
    for lp in launches:   # global, then shared; each in source order
        lp.sites.sort(key=lambda s: (order[s.space], [(c.co_filename, c.co_firstlineno, ln)
                                                      for c, ln in reversed(s.site)],
                                     s.array, s.op))


@contextlib.contextmanager
def recording():
    """Recording on within the block (yields the :class:`~numba_flash.kernels.ptx.record.
    Recorder`)."""
    if not on_simulator():
        raise RuntimeError("the memory profile records the simulator's threads: run it without "
                           "a GPU or with NUMBA_ENABLE_CUDASIM=1")
    rec = _record.Recorder()
    with rec:
        yield rec


def record(call):
    """Run ``call()`` with recording on: ``(its result, Profile)``."""
    with recording() as rec:
        result = call()
    return result, Profile(rec)


# ------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------
COLUMNS = ("site", "array", "op", "B/lane", "requests", "B/req", "sectors/req", "ideal",
           "lines/req", "wavefronts/req", "ideal", "ways")


def _num(x):
    """A per-request figure: an integer as such, else two decimals."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def site_row(s, lines=False):
    """The table's cells of one :class:`SiteStats`."""
    r = s.requests
    head = [s.label(lines), s.array, OPS.get(s.op, s.op), str(s.width), str(r),
            _num(s.bytes / r)]
    if s.space == "global":
        return head + [_num(s.sectors / r), _num(s.ideal / r), _num(s.lines / r), "-", "-", "-"]
    return head + ["-", "-", "-", _num(s.wavefronts / r), _num(s.ideal / r), str(s.ways)]


def launch_summary(lp):
    """One line of totals: global bytes asked for and sectors moved, shared wavefronts and
    conflicts, per block."""
    g_req, g_bytes = lp.total("global", "requests"), lp.total("global", "bytes")
    sectors, distinct = lp.total("global", "sectors"), lp.total("global", "distinct")
    s_req, waves = lp.total("shared", "requests"), lp.total("shared", "wavefronts")
    ideal = lp.total("shared", "ideal")
    eff = f"{100 * distinct / (SECTOR * sectors):.0f}%" if sectors else "-"
    return (f"global: {g_req} requests, {g_bytes} B asked, {sectors} sectors ({SECTOR * sectors} "
            f"B moved, {eff} of it asked for), {SECTOR * sectors // lp.blocks} B moved a block; "
            f"shared: {s_req} requests, {waves} wavefronts, {ideal} ideal ({waves - ideal} from "
            f"bank conflicts)")


def render(profile, lines=False, markdown=False, launch=None):
    """The per-site table of every launch (or of kernel ``launch``), as text or Markdown."""
    out = []
    for lp in profile.launches:
        if launch is not None and lp.name != launch:
            continue
        ln = lp.launch
        head = f"{lp.name}: grid {ln.grid}, block {ln.block}"
        rows = [site_row(s, lines) for s in lp.sites]
        if markdown:
            out += [f"**{head}**", "", "| " + " | ".join(COLUMNS) + " |",
                    "|" + "---|" * len(COLUMNS)]
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows]
            out += ["", launch_summary(lp), ""]
            continue
        widths = [max(len(c) for c in col) for col in zip(COLUMNS, *rows)]
        out.append(head)
        for r in [COLUMNS, *rows]:
            out.append("  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                 for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        out += [launch_summary(lp), ""]
    return "\n".join(out).rstrip() + "\n"


# ------------------------------------------------------------------------------------------
# the teaching kernels: the known answers (docs/memory-access.md)
# ------------------------------------------------------------------------------------------
#: the 32 x 32 float32 matrix of the coalescing and transpose demos, and the transpose's block
N_DEMO = 32
TRANSPOSE_BLOCK = (32, 4)


def _kernels():
    """The teaching kernels, built on first use (``cuda.jit``)."""
    k = {}

    # [docs:coalescing-kernels]
    @cuda.jit
    def sum_rows(x, out):
        """Lane ``c`` adds up column ``c``: each step the warp reads one row (coalesced)."""
        c = cuda.threadIdx.x
        acc = float32(0)
        for r in range(x.shape[0]):
            acc += x[r, c]           # 32 lanes, 32 consecutive floats: 128 bytes
        out[c] = acc

    @cuda.jit
    def sum_columns(x, out):
        """Lane ``r`` adds up row ``r``: each step the warp reads one column (strided)."""
        r = cuda.threadIdx.x
        acc = float32(0)
        for c in range(x.shape[1]):
            acc += x[r, c]           # 32 lanes, 32 floats a row (128 bytes) apart
        out[r] = acc
    # [/docs:coalescing-kernels]

    k["sum_rows"], k["sum_columns"] = sum_rows, sum_columns
    return k


_KERNELS = {}


def kernels():
    """``{name: kernel}`` of the coalescing demos (``sum_rows``, ``sum_columns``)."""
    if not _KERNELS:
        _KERNELS.update(_kernels())
    return _KERNELS


def transpose_kernel(tile_offset):
    """``kernel(x, y)``: ``y = x.T`` of a 32 x 32 float32 ``x`` through a shared tile of 32 x 32
    words (block :data:`TRANSPOSE_BLOCK`, one warp a ``threadIdx.y``), element ``(r, c)`` of
    the tile at word ``tile_offset(r, c)`` (a device function: ``r * 32 + c`` row-major, or a
    swizzle)."""
    offset = cuda.jit(device=True)(tile_offset)

    # [docs:transpose-kernel]
    @cuda.jit
    def transpose(x, y):
        tile = cuda.shared.array(1024, float32)       # 32 x 32 words, 4 KiB
        c = cuda.threadIdx.x                          # the lane
        for r in range(cuda.threadIdx.y, 32, 4):      # warp ty: rows ty, ty + 4, ...
            tile[offset(r, c)] = x[r, c]              # read a row of x, write a row of the tile
        cuda.syncthreads()
        for r in range(cuda.threadIdx.y, 32, 4):
            y[r, c] = tile[offset(c, r)]              # read a column of the tile, write a row
    # [/docs:transpose-kernel]

    return transpose


def padded_transpose_kernel(pad):
    """``kernel(x, y)``: the transpose through a ``[32][32 + pad]`` float32 tile."""
    @cuda.jit
    def transpose_padded(x, y):
        tile = cuda.shared.array((32, 32 + pad), float32)
        c = cuda.threadIdx.x
        for r in range(cuda.threadIdx.y, 32, 4):
            tile[r, c] = x[r, c]
        cuda.syncthreads()
        for r in range(cuda.threadIdx.y, 32, 4):
            y[r, c] = tile[c, r]

    return transpose_padded


def row_major(r, c):
    """Element ``(r, c)`` of a 32 x 32 tile at word ``32 r + c`` (a column: one bank)."""
    return r * 32 + c


def xor_swizzle(r, c):
    """Element ``(r, c)`` at word ``32 r + (c ^ r)``: each row's 32 words permuted, so that a
    row and a column both meet all 32 banks."""
    return r * 32 + (c ^ r)


#: the layouts of the ldmatrix demo's tile of 16-bit elements, 16 rows of 64 (128 bytes):
#: ``(row, 16-byte chunk) -> byte offset``
LDMATRIX_LAYOUTS = {
    "row-major": lambda r, ch: 128 * r + 16 * ch,
    "padded": lambda r, ch: 144 * r + 16 * ch,                # a row of 128 + 16 bytes
    "swizzled": lambda r, ch: 128 * r + 16 * (ch ^ (r % 8)),  # the 128-byte swizzle
}


def ldmatrix_lanes(layout):
    """The byte each lane of one ``ldmatrix .x4`` points at: the ``A`` fragment of rows 0-15,
    columns 0-15 (lanes ``8m .. 8m + 7``: rows ``r + 8 (m & 1)`` of chunk ``m >> 1``)."""
    at = LDMATRIX_LAYOUTS[layout]
    return [at((lane & 7) + 8 * ((lane >> 3) & 1), lane >> 4) for lane in range(32)]


def ldmatrix_kernel():
    """``kernel(tile, offsets, regs)``: one warp copies ``tile`` (uint32 words) to shared memory
    and does one ``ldmatrix .x4`` with lane ``l`` at byte ``offsets[l]`` (``regs[l]``: its
    four registers)."""
    from numba_flash.kernels.ptx.stages import ldmatrix_x4

    @cuda.jit
    def ldmatrix_demo(tile, offsets, regs):
        lane = cuda.threadIdx.x
        smem = cuda.shared.array(576, types.uint32)   # 16 rows of 144 bytes at most
        for i in range(lane, tile.shape[0], 32):
            smem[i] = tile[i]
        cuda.syncthreads()
        r0, r1, r2, r3 = ldmatrix_x4(smem, offsets[lane])
        regs[lane, 0] = r0
        regs[lane, 1] = r1
        regs[lane, 2] = r2
        regs[lane, 3] = r3

    return ldmatrix_demo


def demo(name):
    """Run one teaching kernel in recording mode: ``(result, Profile)``.  Names: ``rows``,
    ``columns`` (the coalescing pair), ``transpose`` (row-major tile), ``transpose_padded``,
    ``transpose_swizzled``, ``ldmatrix_row-major``, ``ldmatrix_padded``,
    ``ldmatrix_swizzled``."""
    x = np.arange(N_DEMO * N_DEMO, dtype=np.float32).reshape(N_DEMO, N_DEMO)
    if name in ("rows", "columns"):
        out = np.zeros(N_DEMO, np.float32)
        k = kernels()["sum_" + name]
        _, prof = record(lambda: k[1, 32](x, out))
        return out, prof
    if name.startswith("transpose"):
        y = np.zeros_like(x)
        k = {"transpose": lambda: transpose_kernel(row_major),
             "transpose_swizzled": lambda: transpose_kernel(xor_swizzle),
             "transpose_padded": lambda: padded_transpose_kernel(1)}[name]()
        _, prof = record(lambda: k[1, TRANSPOSE_BLOCK](x, y))
        return y, prof
    if name.startswith("ldmatrix_"):
        layout = name[len("ldmatrix_"):]
        at = LDMATRIX_LAYOUTS[layout]
        halves = np.zeros(576 * 2, np.uint16)
        for r in range(16):
            for ch in range(8):
                halves[at(r, ch) // 2: at(r, ch) // 2 + 8] = 100 * r + 8 * ch + np.arange(8)
        offsets = np.array(ldmatrix_lanes(layout), np.int32)
        regs = np.zeros((32, 4), np.uint32)
        k = ldmatrix_kernel()
        _, prof = record(lambda: k[1, 32](halves.view(np.uint32), offsets, regs))
        return regs, prof
    raise ValueError(f"demo: unknown {name!r}; choose from {', '.join(DEMOS)}")


DEMOS = ("rows", "columns", "transpose", "transpose_padded", "transpose_swizzled",
         "ldmatrix_row-major", "ldmatrix_padded", "ldmatrix_swizzled")


# ------------------------------------------------------------------------------------------
# the public ops on small problems, with the simulator's tiles or the GPU build's
# ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def gpu_tiles(head_dim, dtype="float16"):
    """Within the block the simulator builds the tensor-core forward, the tensor-core backward
    and the decode kernel with the tiles the GPU build of ``head_dim`` has (the compile tier's
    configurations: warps, row tiles, keys per tile, stages; decode's lanes, rows and keys per
    step), not its own small ones: the same accesses per warp as on the GPU, at the cost of
    more simulated threads.  (The tables' constants are swapped and put back.)"""
    from numba_flash.kernels.backward import config as bconfig
    from numba_flash.kernels.core.common import padded_head_dim
    from numba_flash.kernels.decode import config as dconfig
    from numba_flash.kernels.forward import config as fconfig

    hd = padded_head_dim(head_dim)
    lanes, _ = dconfig.lane_layout(dtype, hd, simulator=False)
    rows = dconfig.gpu_rows_max(dtype, hd)
    swaps = [(fconfig, "FORWARD_MMA_SIM_TILES", fconfig.FORWARD_MMA_TILES[hd]),
             (bconfig, "BACKWARD_MMA_SIM_TILES", bconfig.BACKWARD_MMA_TILES[hd]),
             (dconfig, "SIM_THREADS", dconfig.GPU_THREADS), (dconfig, "SIM_LANES", lanes),
             (dconfig, "SIM_ROWS_MAX", rows),
             (dconfig, "SIM_KEYS_PER_STEP", dconfig.keys_per_step(rows, hd // lanes))]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in swaps]
    try:
        for mod, name, value in swaps:
            setattr(mod, name, value)
        yield
    finally:
        for mod, name, value in saved:
            setattr(mod, name, value)


def _inputs(shape, dtype, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape).astype(dtype)


def op_call(op, head_dim=64, seqlen=None, dtype=None, causal=False, seed=0,
            deterministic=False):
    """``(call, dtype, seqlen)``: a zero-argument call of the public op ``op`` on a small
    problem (batch 1; ``seqlen`` queries and keys):

    * ``forward``: the SIMT forward (``kernel="simt"``), float32 by default;
    * ``mma``: the tensor-core forward (``kernel="mma"``), float16;
    * ``wgmma``: the warpgroup forward (``kernel="wgmma"``, 128-byte swizzled tiles), float16;
    * ``backward``: the tensor-core backward (``kernel="mma"``: its dK/dV kernel, with
      ``deterministic`` the dQ kernel too; the forward it needs runs first, unrecorded),
      float16;
    * ``decode``: one query token a sequence (8 query heads on 2 kv heads: four rows a group),
      a paged cache of 16-token blocks, float16;
    * ``teach``: the teaching tiled forward (docs/tiled-forward.md), float32.
    """
    nf = numba_flash
    if op not in OP_DEFAULTS:
        raise ValueError(f"op: expected one of {', '.join(OP_DEFAULTS)}, got {op!r}")
    d_dtype, d_len = OP_DEFAULTS[op]
    dtype = np.dtype(dtype or d_dtype)
    n = int(seqlen or d_len)
    if op == "decode":
        h, hkv, bs = 8, 2, 16
        blocks = -(-n // bs)
        q = _inputs((1, h, head_dim), dtype, seed)
        kc = _inputs((blocks, hkv, bs, head_dim), dtype, seed + 1)
        vc = _inputs((blocks, hkv, bs, head_dim), dtype, seed + 2)
        table = np.arange(blocks, dtype=np.int32)[None, :]
        lens = np.array([n], np.int32)
        return (lambda: nf.decode(q, kc, vc, cache_seqlens=lens, block_table=table)), dtype, n
    q, k, v = (_inputs((1, 1, n, head_dim), dtype, seed + i) for i in range(3))
    if op == "teach":
        from numba_flash.teach.ops.tiled_forward import tiled_forward_teach

        return (lambda: tiled_forward_teach(q, k, v, causal=causal)), dtype, n
    if op in ("forward", "mma", "wgmma"):
        kernel = "simt" if op == "forward" else op
        return (lambda: nf.forward(q, k, v, causal=causal, kernel=kernel)), dtype, n
    o, lse = nf.forward(q, k, v, causal=causal, return_lse=True, kernel="mma")
    do = _inputs(o.shape, dtype, seed + 3)
    return (lambda: nf.backward(do, q, k, v, o, lse, causal=causal, kernel="mma",
                                deterministic=deterministic)), dtype, n


#: each op's default element type and sequence length
OP_DEFAULTS = {"forward": ("float32", 32), "mma": ("float16", 32), "wgmma": ("float16", 32),
               "backward": ("float16", 32),
               "decode": ("float16", 32), "teach": ("float32", 8)}


def profile_op(op, head_dim=64, seqlen=None, dtype=None, causal=False, tiles="sim", seed=0,
               deterministic=False):
    """Record one call of ``op`` (:func:`op_call`; ``tiles="gpu"``: :func:`gpu_tiles`):
    ``(result, Profile)``."""
    if tiles not in ("sim", "gpu"):
        raise ValueError(f"tiles: expected 'sim' or 'gpu', got {tiles!r}")
    ctx = gpu_tiles(head_dim) if tiles == "gpu" else contextlib.nullcontext()
    with ctx:
        call, _, _ = op_call(op, head_dim, seqlen, dtype, causal, seed, deterministic)
        return record(call)


# ------------------------------------------------------------------------------------------
# the goal builds' tables (docs/resources.md's memory tier)
# ------------------------------------------------------------------------------------------
class GoalBuild(dict):
    """One goal build of docs/resources.md: ``title``, the op call (``op``, ``head_dim``,
    ``seqlen``, ``kw``: :func:`op_call`'s extra arguments), run with the GPU's tiles, and per
    kernel shown ``{kernel: (the compile tier's configuration name, the loop's frame, loop
    steps a warp)}``: the name finds the SASS tier's row, the frame (a function of the K/V
    loop) the sites whose per-warp, per-step shared reads stand beside it."""


GOAL_BUILDS = (
    GoalBuild(title="tensor-core forward, float16, d = 64", op="mma", head_dim=64, seqlen=128,
              kw={}, kernels={"flash_forward_mma": ("forward_mma W4 M128 N64 D64 S2 float16",
                                                    "step", 2)}),
    GoalBuild(title="tensor-core forward, float16, d = 128", op="mma", head_dim=128, seqlen=64,
              kw={}, kernels={"flash_forward_mma": (
                  "forward_mma W2 M64 N32 D128 S1 Qsmem float16", "step", 2)}),
    GoalBuild(title="tensor-core backward, float16, d = 64 (dQ by atomics in the dK/dV kernel)",
              op="backward", head_dim=64, seqlen=64, kw={},
              kernels={"backward_dkdv_mma": (
                  "backward_mma dkdv (dk dv dq) W2 N64 M16 D64 S1 float16", "step", 4)}),
    GoalBuild(title="tensor-core backward, float16, d = 64, deterministic (the dQ kernel)",
              op="backward", head_dim=64, seqlen=64, kw={"deterministic": True},
              kernels={"backward_dq_mma": ("backward_mma dq (dq) W4 M64 N32 D64 S2 float16",
                                           "step", 2)}),
    GoalBuild(title="decode, float16, d = 128 (8 query heads on 2 kv heads, paged)",
              op="decode", head_dim=128, seqlen=32, kw={},
              kernels={"decode_split": ("decode float16 D=128 ROWS=4 U=2", "one_step", 1)}),
)

#: the heading of the memory tier in docs/resources.md (it runs to the end of the file)
MEMORY_TIER = "## Memory tier: how each access behaves, counted in the simulator"


def _loop_reads(lp, frame, steps):
    """``(requests, bytes)`` of shared reads per warp and loop step: the sites whose call chain
    passes through function ``frame``."""
    warps = lp.blocks * -(-math.prod(lp.launch.block or (1,)) // 32)
    reads = [s for s in lp.sites if s.space == "shared" and s.op in ("ld", "ldsm", "wgmma")
             and any(code.co_name == frame for code, _ in s.site)]
    req = sum(s.requests for s in reads) / (warps * steps)
    return req, sum(s.bytes for s in reads) / (warps * steps)


def sass_rows(text):
    """``{configuration: {column: cell}}`` of the SASS tier's table in docs/resources.md."""
    part = text.split("## SASS tier", 1)
    if len(part) < 2:
        return {}
    lines = [ln for ln in part[1].split("\n## ", 1)[0].splitlines() if ln.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return {cells[0]: dict(zip(head, cells)) for cells in
            ([c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:])}


def findings(lp):
    """Generated notes of one launch: its bank conflicts (sites with ``ways`` > 1) and its
    global sites that touch more sectors than their bytes need and use under half of what they
    move."""
    waves = lp.total("shared", "wavefronts")
    out = []
    for s in lp.sites:
        if s.space == "shared" and s.ways > 1:
            out.append(f"bank conflict: `{s.label()}` ({s.array}, {OPS.get(s.op, s.op)}): "
                       f"{s.ways}-way, {s.conflicts} extra wavefronts, "
                       f"{100 * s.conflicts / waves:.1f}% of the launch's {waves}")
        elif s.space == "global" and s.sectors > s.ideal and s.distinct < SECTOR * s.sectors / 2:
            out.append(f"sectors part used: `{s.label()}` ({s.array}, {OPS.get(s.op, s.op)}): "
                       f"{_num(s.sectors / s.requests)} sectors a request for "
                       f"{_num(s.distinct / s.requests)} B ({_num(s.ideal / s.requests)} "
                       f"would do)")
    return out or ["no bank conflict; no global site moves more than twice the bytes it needs"]


def goal_section(sass=None, builds=GOAL_BUILDS):
    """The memory tier of docs/resources.md (Markdown), every goal build recorded now (about a
    minute on one core): ``sass`` the SASS tier's rows (:func:`sass_rows`) to stand beside."""
    sass = sass or {}
    out = [MEMORY_TIER, "",
           "Generated by `python -m numba_flash profile --goal-builds --write docs/resources.md` "
           "(`numba_flash.tools.memory_profile`; see [memory access](memory-access.md)). Each "
           "goal build runs once in the simulator with the GPU build's tiles (`--tiles gpu`) on "
           "a small problem, every access recorded; a warp's request is the lanes that ran one "
           "site the same n-th time. Global: bytes a request asks for, 32-byte sectors and "
           "128-byte lines it touches (ideal: the sectors its distinct bytes need). Shared: "
           "wavefronts a request takes (the most different 4-byte words one of the 32 banks "
           "holds, per phase of 128 bytes: 32 lanes of 4 bytes, 8 of 16), ideal one a phase, "
           "ways the worst phase's. Sites: the call chain in the kernel, a function and the "
           "line's offset from its `def` (`--lines` gives files and lines). Beside each, the "
           "SASS tier's shared loads per warp and loop iteration, and the simulator's own "
           "count of the same (the loop's shared reads per warp and step). Nsight Compute's "
           "figures for the same sites: unmeasured (no GPU).", ""]
    for gb in builds:
        with gpu_tiles(gb["head_dim"]):
            call, dtype, n = op_call(gb["op"], gb["head_dim"], gb["seqlen"], **gb["kw"])
            _, prof = record(call)
        for lp in prof.launches:
            if lp.name not in gb["kernels"]:
                continue
            cfg, frame, steps = gb["kernels"][lp.name]
            req, nbytes = _loop_reads(lp, frame, steps)
            row = sass.get(cfg, {})
            out += [f"### {gb['title']}", "",
                    f"`{cfg}`, kernel `{lp.name}`; problem: N = {n}, d = {gb['head_dim']}, "
                    f"{dtype}, batch 1; grid {lp.launch.grid}, block {lp.launch.block}. Shared "
                    f"reads per warp and loop step: SASS tier {row.get('LDS+LDSM', '?')} "
                    f"instructions, {row.get('smem B', '?')} B; simulator {_num(req)} requests, "
                    f"{_num(nbytes)} B.", ""]
            out += render(prof, markdown=True, launch=lp.name).rstrip("\n").splitlines()[2:]
            out += [""] + [f"* {f}" for f in findings(lp)] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def write_resources(path):
    """Replace (or add) the memory tier at the end of ``path`` (docs/resources.md)."""
    text = open(path).read()
    head = text.split("\n" + MEMORY_TIER, 1)[0].rstrip("\n")
    section = goal_section(sass_rows(head))
    with open(path, "w") as fh:
        fh.write(head + "\n\n" + section)
    return section


# ------------------------------------------------------------------------------------------
# the command line: numba-flash profile
# ------------------------------------------------------------------------------------------
def build_parser(prog="numba-flash profile"):
    ap = argparse.ArgumentParser(
        prog=prog, description="Run one call of a public op (or a teaching kernel) on a small "
        "problem in the simulator with every memory access recorded, and print per kernel "
        "site the warp requests, global sectors and lines, shared wavefronts and bank-conflict "
        "ways.")
    ap.add_argument("op", nargs="?", default=None,
                    help=f"{', '.join(OP_DEFAULTS)}, or demo:NAME[,NAME...] "
                         f"({', '.join(DEMOS)})")
    ap.add_argument("--head-dim", type=int, default=64, help="d (default 64)")
    ap.add_argument("--seqlen", type=int, default=None,
                    help="queries and keys (decode: cached keys); default: the op's small one")
    ap.add_argument("--dtype", default=None, help="element type (default: the op's)")
    ap.add_argument("--causal", action="store_true", help="causal attention")
    ap.add_argument("--deterministic", action="store_true",
                    help="backward: the deterministic dQ kernel (no atomics)")
    ap.add_argument("--tiles", choices=("sim", "gpu"), default="sim",
                    help="the simulator's small tiles (default) or the GPU build's (mma, "
                         "backward, decode: more threads, the GPU's access pattern)")
    ap.add_argument("--kernel", default=None, help="only the launches of this kernel")
    ap.add_argument("--lines", action="store_true",
                    help="sites as files and lines (Nsight Compute's source view)")
    ap.add_argument("--markdown", action="store_true", help="Markdown tables")
    ap.add_argument("--ncu", action="store_true",
                    help="per source line, Nsight Compute's metric names beside the simulator's "
                         "figures (the comparison's format; the ncu column unmeasured)")
    ap.add_argument("--goal-builds", action="store_true",
                    help="the goal builds' tables (docs/resources.md's memory tier)")
    ap.add_argument("--write", metavar="FILE", default=None,
                    help="with --goal-builds: replace the memory tier at the end of FILE")
    return ap


def main(argv=None, prog="numba-flash profile"):
    ap = build_parser(prog)
    args = ap.parse_args(argv)
    if args.goal_builds:
        if args.write:
            write_resources(args.write)
            print(f"wrote the memory tier of {args.write}")
        else:
            print(goal_section(), end="")
        return 0
    if args.op is None:
        ap.error("an op is needed (or --goal-builds)")
    if args.op.startswith("demo:"):   # demo:NAME[,NAME...]: each recorded and printed
        names = args.op[len("demo:"):].split(",")
        for name in names[:-1]:
            _, prof = demo(name)
            print(prof.table(lines=args.lines, markdown=args.markdown, launch=args.kernel))
        _, prof = demo(names[-1])
    else:
        if args.op not in OP_DEFAULTS:
            ap.error(f"unknown op {args.op!r}; choose from {', '.join(OP_DEFAULTS)} or demo:NAME")
        _, prof = profile_op(args.op, args.head_dim, args.seqlen, args.dtype, args.causal,
                             args.tiles, deterministic=args.deterministic)
    if args.ncu:
        print(prof.ncu_table(args.kernel), end="")
    else:
        print(prof.table(lines=args.lines, markdown=args.markdown, launch=args.kernel), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(prog="python -m numba_flash.tools.memory_profile"))
