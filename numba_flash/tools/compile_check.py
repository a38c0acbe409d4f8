"""The compile tier: build every launchable kernel configuration to PTX and assemble it.

The simulator hides what only the device compiler shows: float64 promotion in float32 code,
register spills and shared-memory overruns.  This module compiles each configuration that the
catalog (:mod:`numba_flash.tools.catalog`) lists with ``numba.cuda.compile_ptx`` (NVVM, no GPU
needed) for sm_80 and sm_90, assembles the PTX with ``ptxas -v`` from the ``nvidia-cuda-nvcc``
wheel, and reports registers, shared memory, spills and any ``.f64`` instruction.

It must run in a process where ``numba.cuda`` is the real CUDA target, not the simulator::

    NUMBA_ENABLE_CUDASIM=0 python -m numba_flash.tools.compile_check [--cc 80,90] [--json FILE] [-k
    TEXT]

prints a resource table and exits 1 if any configuration fails a check:

* no ``.f64`` instruction in a kernel whose inputs are float16/float32;
* no spill stores or loads, and no stack frame (local memory: a local array indexed at run time,
  or a call that could not be inlined);
* static shared memory at most 48 KiB per block (the limit without a dynamic opt-in).

With ``--sass`` each sm_90 cubin is also disassembled (nvdisasm, ``nvidia-cuda-nvdisasm`` wheel)
and one iteration of its steady-state loop counted by instruction class
(:mod:`numba_flash.tools.sass`): instructions, MMAs, non-MMA instructions per MMA, global bytes per
instruction and the issue-bound ceiling on an H200.  ``--dump NAME`` prints the SASS of the
configurations whose name contains NAME, the loop marked.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import multiprocessing as mp
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from numba_flash.tools import sass
from numba_flash.kernels.core.common import SMEM_LIMIT  # 48 KiB of static shared memory per block

#: the architecture whose machine code the SASS tier counts (the H200's), and its variant with
#: the architecture-specific instructions (``wgmma``: a configuration asks for it with ``"cc"``)
SASS_CC = (9, 0)
SASS_CCS = ((8, 9), (9, 0), (9, 0, "a"))


def arch_name(cc):
    """``sm_80``, ``sm_90``, ``sm_90a`` for a compute capability tuple."""
    return f"sm_{cc[0]}{cc[1]}{cc[2] if len(cc) > 2 else ''}"

_F64 = re.compile(r"^\s*(?:@%p\d+\s+)?[a-z][a-z0-9_.]*\.f64\b", re.M)


#: the compile tier's tools and the wheels of the test extra that bring them (pinned in setup.cfg)
TOOL_WHEELS = {"ptxas": "nvidia-cuda-nvcc", "nvdisasm": "nvidia-cuda-nvdisasm"}


def wheel_tool(name):
    """A CUDA tool (``ptxas``, ``nvdisasm``) from NVIDIA's wheels (the newest ``cu*/bin``: new
    enough for NVVM's PTX); None when no wheel has it (a tool on PATH is not looked at)."""
    try:
        import nvidia
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(glob.glob(os.path.join(root, "cu*", "bin", name)), reverse=True):
            if os.access(cand, os.X_OK):
                return cand
    return None


def find_nvidia_tool(name):
    """A CUDA tool from NVIDIA's wheels (:func:`wheel_tool`), else from PATH; None when neither
    has it.  The tests' builds take either; ``compile-check`` (whose tables are the pinned
    toolchain's) takes the wheel's only."""
    return wheel_tool(name) or shutil.which(name)


def find_ptxas():
    """ptxas from the nvidia-cuda-nvcc wheel, else from PATH."""
    return find_nvidia_tool("ptxas")


def missing_wheel_tool(name):
    """What to say when the test extra's ``name`` is not installed (one line, naming the wheel,
    the tool on PATH that is not used, and the install command); None when the wheel has it."""
    if wheel_tool(name):
        return None
    from numba_flash.install_hints import pip_extra

    system = shutil.which(name)
    return (f"{name} of the {TOOL_WHEELS[name]} wheel (the test extra's pinned toolchain) "
            f"cannot be found" + (f"; the one on PATH, {system}, is not it" if system else "")
            + f"; install the test extra with: {pip_extra('test')}")


def parse_ptxas(text):
    """Registers, shared bytes, spill bytes and stack frame from ``ptxas -v`` output."""
    def grab(pattern):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else 0
    return {
        "registers": grab(r"Used (\d+) registers"),
        "smem": grab(r"(\d+) bytes smem"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack": grab(r"(\d+) bytes stack frame"),
    }


def f64_lines(ptx):
    """PTX instructions that operate on float64 (``add.f64``, ``cvt.f64.f32``, ``fma.rn.f64``)."""
    return [m.group(0).strip() for m in _F64.finditer(ptx)]


def all_configs(selector=None, suite=False):
    """Every configuration of every kernel module (``suite``: the test suite's selection,
    :func:`in_suite`), optionally those whose name contains ``selector``."""
    from numba_flash.tools import catalog

    for cfg in catalog.configs():
        if (selector is None or selector in cfg["name"]) and (not suite or in_suite(cfg)):
            yield suite_target(cfg) if suite else cfg


def suite_target(cfg):
    """The suite's build of a configuration: the ``mma.sync`` kernels (their base architecture
    is sm_80, where their register allocation and spills differ) for sm_80 and sm_90, the
    others for sm_90 alone (a ``cc`` of their own: the SASS tier's architecture; sm_80's build
    of a SIMT kernel is the same code, scheduled by another ptxas target, and ``compile-check``
    without ``--suite`` builds it for docs/resources.md)."""
    if "cc" in cfg or cfg.get("mma") or cfg["name"].startswith("mla_decode"):
        return cfg
    return dict(cfg, cc=(9, 0))


def _plain(c):
    """A tensor-core configuration without variant flags, float16, 16-byte copies."""
    return (c.DTYPE == "float16" and c.VEC and c.USER is None
            and not (c.DROPOUT or c.SOFTCAP or c.ALIBI))


def _every_flag(c):
    """Every variant flag at once (float16, 16-byte copies)."""
    return (c.DROPOUT and c.SOFTCAP and c.ALIBI and c.VEC and c.USER is None
            and c.DTYPE == "float16")


def goal_config(c):
    """A configuration the static goals hold (tests/compile): the tensor-core forward and both
    backward kernels, float16, no flags, at ``HEAD_DIM`` 64 and 128 (the whole dK/dV pass)."""
    from numba_flash.kernels.backward.config import BackwardMmaConfig
    from numba_flash.kernels.forward.config import ForwardMmaConfig

    if isinstance(c, (ForwardMmaConfig, BackwardMmaConfig)):
        whole = not isinstance(c, BackwardMmaConfig) or c.ACC == c.HEAD_DIM
        return (_plain(c) and c.HEAD_DIM in (64, 128) and whole
                and not getattr(c, "STRIDED", False))
    return False


def wgmma_goal_config(c):
    """A configuration of the warpgroup forward's static goal (tests/compile): the tile
    table's build, float16, no flags, 16-byte copies, at ``HEAD_DIM`` 64 and 128."""
    from numba_flash.kernels.forward.config import ForwardWgmmaConfig, forward_wgmma_config

    return (isinstance(c, ForwardWgmmaConfig) and _plain(c) and c.HEAD_DIM in (64, 128)
            and c == forward_wgmma_config(c.HEAD_DIM, simulator=False))


def in_suite(cfg):
    """Whether the test suite's compile tier builds this configuration
    (``numba-flash compile-check`` and docs/resources.md build every one). The selection keeps
    every static goal and one build of each kernel family's code paths, so the suite stays fast
    on two cores: the families with a configuration named tuple (``cfg["config"]``:
    :mod:`numba_flash.kernels.core.config`) are selected by its fields, never by name, so a
    retuned tile stays in. Where one build's flags are a superset of another's (causal over
    non-causal, dropout over plain), the superset build compiles the other's code and stands
    for it. In: the static goals (:func:`goal_config`, :func:`wgmma_goal_config`); the
    tensor-core forward's every-flag float16 build at ``HEAD_DIM`` 128; decode at 128, paged,
    16-byte loads, in float16 (plain, a user's variant, the e4m3 caches, tokens-first with the
    e4m3 cache, the token-sparse gather) and float32; the SIMT forward in float32 at 64 (also
    element-wise loads) and 128, in float64 at 64, bfloat16 with every flag, a user's variant
    and the varlen paged prefill once each; MLA's decode in float16, dense at 576/512 and with
    lists (at 128 with a value head dim of its own); the token-sparse backward with softcap and
    ALiBi; by name, the teaching kernels at d = 64 (causal in each type; the row kernel's
    float64 build is non-causal), the SIMT backward at d = 64 in float32 (plain, and dK/dV with
    dropout), float16 and float64 (dQ: the float32 kernels with 16-bit and 64-bit element
    loads) and at 128 in float32, its row-mass kernel at 64, the wgmma probes' chained products;
    the e4m3 forwards' d = 128 builds (sm_89's ``mma.sync`` and sm_90a's warpgroup build, a
    static goal); every small kernel (softmax, merge, rotary, the KV cache, the stage probes),
    without the float64 builds of merge, rotary and the KV cache. Out: the rest, among them the
    SIMT forward at head dims 16, 32 and 256, its plain float16 and non-paged varlen builds,
    decode in bfloat16 and float64, its float16 tokens-first build, MLA's decode in bfloat16
    and its 576/512 build with lists, whose code the kept builds compile. The selection's size:
    docs/compile-tier.md; its build time with and without :mod:`numba_flash.numba_inline`:
    README.md."""
    from numba_flash.kernels.backward.config import BackwardMmaConfig, SparseBackwardConfig
    from numba_flash.kernels.decode.config import DecodeConfig
    from numba_flash.kernels.forward.config import (
        ForwardSimtConfig, ForwardMmaConfig, ForwardWgmmaConfig,
    )

    name, c = cfg["name"], cfg.get("config")
    if isinstance(c, ForwardWgmmaConfig):   # the warpgroup forward: its goal builds (sm_90a)
        return wgmma_goal_config(c)
    if isinstance(c, (ForwardMmaConfig, BackwardMmaConfig)):
        if isinstance(c, BackwardMmaConfig):   # the goals alone (a dK/dV build is minutes)
            return goal_config(c)
        return (goal_config(c) or (_every_flag(c) and c.HEAD_DIM == 128 and c.DTYPE == "float16")
                or (c.STRIDED and c.HEAD_DIM == 64))   # read through strides: once
    if isinstance(c, SparseBackwardConfig):   # the token-sparse backward: every flag, once
        return c.SOFTCAP and c.ALIBI
    if isinstance(c, DecodeConfig):   # float16 (the goal) and a user's variant; float32
        if not (c.HEAD_DIM == 128 and c.VEC and c.PAGED and not (c.SOFTCAP or c.ALIBI)):
            return False
        if c.SLOT_STRIDE and not c.KV_FP8:   # tokens-first: the e4m3 cache's build has it
            return False
        return c.DTYPE == "float16" or (c.USER is None and c.DTYPE == "float32")
    if isinstance(c, ForwardSimtConfig):
        flags = c.DROPOUT or c.SCORE_MOD
        if c.OWN_V:   # a value head dim of its own: docs/resources.md only
            return False
        if c.STRIDED:   # read through strides: float32 (cp.async) once
            return c.DTYPE == "float32"
        if c.USER is not None:   # a user's variant: once, without paging
            return not (c.PAGED or c.VARLEN)
        if c.PAGED:   # varlen and the paged prefill at once
            return c.HEAD_DIM == 64 and c.DTYPE == "float32"
        if c.VARLEN:  # the paged build has it
            return False
        if c.HEAD_DIM != 64:   # the goal at 128 (256: the same code, a wider tile)
            return c.HEAD_DIM == 128 and c.DTYPE == "float32" and c.VEC and not flags
        if c.DTYPE == "bfloat16":   # 16-bit element loads and every flag
            return c.DROPOUT and c.SCORE_MOD
        return not flags and c.DTYPE in ("float32", "float64") and (c.VEC or c.DTYPE != "float64")
    if name.startswith("wgmma"):  # the warpgroup stages' probes: the chained products
        return "chain" in name
    if name.startswith("forward_wgmma_fp8"):   # the e4m3 warpgroup forward: its goal, d = 128
        return " D128 " in name and name.endswith("bfloat16")
    if name.startswith("forward_fp8"):   # the e4m3 forward (sm_89): its d = 128 build
        return " D128 " in name and name.endswith("bfloat16")
    if name.startswith("mla_decode"):  # MLA's tensor-core decode: float16 (bfloat16: the same)
        return name.endswith((" float16", " own_v kv_indices"))   # lists: once, at 128
    if name.startswith(("naive_forward", "row_forward", "tiled_forward_teach")):
        # at 64, causal (its code holds the non-causal one's) in each type; row_forward's
        # float64 build is its non-causal one
        return (("=64 " in name or " D64 " in name)
                and ("CAUSAL=1" in name or name.startswith("row_forward") and "float64" in name))
    if name.startswith("backward row_mass"):   # the float32 backward's first kernel: at 64
        return " D64 " in name
    if name.startswith(("backward dkdv", "backward dq")):
        if "dropout" in name:   # dK/dV's dropout (P's and dP's masks; dQ's is dP's alone)
            return " D64 " in name and "float32" in name and name.startswith("backward dkdv")
        if " D128 " in name:
            return "float32" in name
        if "float16" in name or "float64" in name:   # 16-/64-bit element loads: dQ once
            return " D64 " in name and name.startswith("backward dq") and "bfloat16" not in name
        return " D64 " in name and "bfloat16" not in name
    if name.startswith(("merge", "rotary", "append_kv")) and "float64" in name:
        return False   # float64: no f64 scan to make, and no pressure a small kernel could spill
    return True


@contextlib.contextmanager
def _device_functions_for(cc):
    """Let ``@cuda.jit(device=True)`` functions called by a kernel compile with no GPU.

    numba-cuda compiles such a device function (``Dispatcher.compile_device``) for the compute
    capability of ``get_current_device()``, which raises without a CUDA driver.  While this
    context is active that lookup answers ``cc`` instead.  The device function's NVVM IR is linked
    into each kernel, and the kernel's PTX is generated for the kernel's own ``cc``.
    """
    import types as pytypes

    from numba.cuda import dispatcher

    original = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = original


def ptx_for_archs(cfg, ccs):
    """PTX of one configuration for each compute capability in ``ccs``.

    Numba's typing and lowering (most of the time of a build) do not depend on the target
    architecture, so the kernel is lowered to NVVM IR once (for the lowest ``cc``) and NVVM turns
    that IR into PTX for each architecture (``CUDACodeLibrary.get_asm_strs(cc)``, the same calls
    ``numba.cuda.compile_ptx`` makes).  Falls back to one ``compile_ptx`` per architecture if that
    internal entry point moves.
    """
    from numba import cuda, types

    sig = types.void(*cfg["args"])
    fastmath = cfg.get("fastmath", False)
    try:
        from numba.cuda.compiler import _compile_pyfunc_with_fixup
    except ImportError:  # pragma: no cover - other numba-cuda versions
        _compile_pyfunc_with_fixup = None
    if _compile_pyfunc_with_fixup is None:
        out = {}
        for cc in ccs:
            with _device_functions_for(cc):
                out[cc] = cuda.compile_ptx(cfg["kernel"].py_func, sig, cc=cc, fastmath=fastmath,
                                           launch_bounds=cfg.get("launch_bounds"))[0]
        return out
    with _device_functions_for(min(ccs)):
        lib, _ = _compile_pyfunc_with_fixup(cfg["kernel"].py_func, sig, device=False,
                                            fastmath=fastmath, cc=min(ccs), abi="numba",
                                            launch_bounds=cfg.get("launch_bounds"))
    return {cc: lib.get_asm_strs(cc=cc)[0] for cc in ccs}


def assemble(ptx, cc, ptxas, nvdisasm=None):
    """Run ``ptxas -v`` on the PTX; return (returncode, combined output, SASS listing or None).
    The listing (``nvdisasm -c`` of the cubin) only when ``nvdisasm`` is given."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(src, "w") as fh:
            fh.write(ptx)
        proc = subprocess.run([ptxas, f"-arch={arch_name(cc)}", "-v", src, "-o", cubin],
                              capture_output=True, text=True)
        listing = None
        if nvdisasm and proc.returncode == 0:
            listing = sass.disassemble(cubin, nvdisasm)
    return proc.returncode, proc.stderr + proc.stdout, listing


def build(cfg, ccs, ptxas, nvdisasm=None):
    """Compile one configuration for each compute capability; return one row per cc (with the
    SASS tier's counts in ``row["sass"]`` for sm_90 when ``nvdisasm`` is given).  A
    configuration with a ``"cc"`` of its own (``(9, 0, "a")``: Hopper's ``wgmma``, which ptxas
    refuses for any other target) is built for that one only."""
    t0 = time.perf_counter()
    if "cc" in cfg:
        ccs = [tuple(cfg["cc"])]
    rows = [{"name": cfg["name"], "cc": arch_name(cc), "float64_ok": cfg["float64_ok"],
             "dynamic_smem": cfg.get("dynamic_smem", 0)} for cc in ccs]
    try:
        ptxs = ptx_for_archs(cfg, ccs)
    except Exception as exc:  # one broken configuration must not hide the others
        err = f"compile: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        for row in rows:
            row.update(f64=[], ptxas_rc=-1, ptxas_err=err, registers=0, smem=0, spill_stores=0,
                       spill_loads=0, stack=0, problems=[err],
                       seconds=round(time.perf_counter() - t0, 2))
        return rows
    for cc, row in zip(ccs, rows):
        ptx = ptxs[cc]
        row["f64"] = f64_lines(ptx)[:5]
        row["mma_missing"] = bool(cfg.get("mma")) and not any(  # tensor-core kernels
            m in ptx for m in ("mma.sync", "wgmma.mma_async"))
        rc, text, listing = assemble(ptx, cc, ptxas, nvdisasm if cc in SASS_CCS else None)
        row["ptxas_rc"] = rc
        row["ptxas_err"] = "" if rc == 0 else text[-2000:]
        row.update(parse_ptxas(text))
        if listing is not None:
            row["sass"] = sass.analyse(listing, **cfg.get("sass", {}))
            if _DUMP and _DUMP in cfg["name"]:
                row["sass_listing"] = listing
        row["seconds"] = round(time.perf_counter() - t0, 2)
        row["problems"] = problems(row)
    return rows


_CONFIGS = []  # inherited by forked workers (kernel objects do not pickle)
_DUMP = None   # --dump NAME: keep the SASS listing of these configurations

#: what the distributions that write and read a build are called on PyPI: a new version of any
#: of them is a new cache key (BuildCache)
TOOLCHAIN = ("numba", "numba-cuda", "llvmlite", "numpy", "nvidia-nvvm", "nvidia-cuda-nvcc",
             "nvidia-cuda-nvdisasm")


def source_key():
    """The key of every build this checkout makes: a digest of the package's Python sources
    (the kernels, and this module and :mod:`numba_flash.tools.sass`, which read the builds), the
    toolchain's versions (:data:`TOOLCHAIN`), Python's and the ``NUMBA_*`` settings."""
    import hashlib
    import importlib.metadata as metadata
    import pathlib
    import platform

    h = hashlib.sha256(b"compile-tier rows 1\0")
    pkg = pathlib.Path(__file__).resolve().parents[1]   # numba_flash/
    for path in sorted(pkg.rglob("*.py")):
        h.update(path.relative_to(pkg).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in TOOLCHAIN:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{dist}={version}\0".encode())
    h.update(platform.python_version().encode())
    for name in sorted(os.environ):
        if name.startswith("NUMBA_") and name not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR"):
            h.update(f"{name}={os.environ[name]}\0".encode())
    return h.hexdigest()[:20]


class BuildCache:
    """Rows of finished builds on disk, one JSON file per (configuration, architectures, SASS or
    not) under ``root/<source_key()>/``: a second run of the same sources and toolchain builds
    nothing, and processes that build the same selection at once (the test suite's workers)
    share the work: a build in progress is locked (``flock``), and the others take another
    configuration first and read this one when it is done.  Old keys' folders are left for the
    user to delete (the test suite keeps its cache in ``.pytest_cache``: ``pytest
    --cache-clear``)."""

    def __init__(self, root):
        self.dir = os.path.join(os.fspath(root), source_key())
        os.makedirs(self.dir, exist_ok=True)

    def path(self, cfg, ccs, sass_too):
        import hashlib

        ccs = [tuple(cfg["cc"])] if "cc" in cfg else list(ccs)
        what = json.dumps([cfg["name"], [list(c) for c in ccs], bool(sass_too)])
        return os.path.join(self.dir, hashlib.sha1(what.encode()).hexdigest() + ".json")

    @staticmethod
    def load(path):
        try:
            with open(path) as fh:
                return json.load(fh)
        except (OSError, ValueError):
            return None

    @staticmethod
    def store(path, rows):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(rows, fh)
        os.replace(tmp, path)  # readers see the whole file or none

    @staticmethod
    @contextlib.contextmanager
    def lock(path, wait):
        """Hold the build lock of ``path``; yields False (without waiting) if another process
        holds it and ``wait`` is false.  Without ``fcntl`` (Windows) there is no lock."""
        try:
            import fcntl
        except ImportError:  # pragma: no cover - no flock: every process builds what it lacks
            yield True
            return
        with open(path + ".lock", "a") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)


class _BuildJob(NamedTuple):
    """One configuration's build for :func:`build_all`'s workers: its index in ``_CONFIGS``,
    the ccs and tools, the :class:`BuildCache` (or None) and whether to wait for its lock."""

    index: int
    ccs: list
    ptxas: str
    nvdisasm: object
    cache: object
    wait: bool


def _build_job(job):
    cfg = _CONFIGS[job.index]
    if job.cache is None:
        return _timed_build(cfg, job.ccs, job.ptxas, job.nvdisasm)
    path = job.cache.path(cfg, job.ccs, job.nvdisasm is not None)
    with job.cache.lock(path, job.wait) as held:
        if not held:
            return None  # another process builds it: come back when the others are done
        rows = job.cache.load(path)
        if rows is None:
            rows = _timed_build(cfg, job.ccs, job.ptxas, job.nvdisasm)
            job.cache.store(path, rows)
        return rows


def _timed_build(cfg, ccs, ptxas, nvdisasm):
    start = time.perf_counter()
    rows = build(cfg, ccs, ptxas, nvdisasm)
    for row in rows:   # the whole configuration's build time (all its ccs), for the suite's cuts
        row["seconds"] = round(time.perf_counter() - start, 1)
    return rows


@contextlib.contextmanager
def progress_bar(total, stream=None):
    """A rich progress bar on ``stream`` (default: stderr) for ``total`` configurations; yields
    ``step(i, name)``, called as configuration ``i`` (from 1) of ``total`` starts or is
    awaited.  Drawn only when the stream is a terminal: a log, a pipe or the test suite's
    captured output gets nothing (stdout, the table, is never touched)."""
    stream = sys.stderr if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    if not (isatty and isatty()):
        yield lambda i, name: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(file=stream, force_terminal=True)
    with Progress(TextColumn(f"configuration {{task.fields[current]:>{len(str(total))}}} of "
                             f"{total}"),
                  BarColumn(), TimeElapsedColumn(), TextColumn("{task.description}", markup=False),
                  console=console, transient=True) as progress:
        task = progress.add_task("", total=total, current=0)

        def step(i, name):  # the bar counts the configurations done before this one
            progress.update(task, completed=i - 1, current=i, description=name)
            progress.refresh()

        yield step


def build_all(configs, ccs, ptxas, jobs=1, nvdisasm=None, progress=None, cache=None):
    """Build every configuration for every cc, in ``jobs`` forked processes; rows in order.
    ``progress``: a context manager factory like :func:`progress_bar` (called with the number
    of configurations, after the workers are forked, so they inherit no drawing thread).
    ``cache``: a :class:`BuildCache` whose rows are taken instead of a build, and which keeps
    every new build; a configuration another process is building is taken after the others."""
    global _CONFIGS
    _CONFIGS = list(configs)
    progress = progress or (lambda total: contextlib.nullcontext(lambda i, name: None))

    def tasks(indices, wait):
        return [_BuildJob(i, ccs, ptxas, nvdisasm, cache, wait) for i in indices]

    def collect(indices, results, step, done):
        for i in indices:
            step(len(done) + 1, _CONFIGS[i]["name"])
            rows = next(results)
            if rows is not None:
                done[i] = rows

    def run_all(mapper):
        done = {}
        with progress(len(_CONFIGS)) as step:
            first = range(len(_CONFIGS))
            collect(first, mapper(_build_job, tasks(first, False)), step, done)
            later = [i for i in first if i not in done]   # locked by another process
            collect(later, mapper(_build_job, tasks(later, True)), step, done)
        return [done[i] for i in range(len(_CONFIGS))]

    if jobs <= 1 or len(_CONFIGS) < 2 or "fork" not in mp.get_all_start_methods():
        results = run_all(map)
    else:
        with mp.get_context("fork").Pool(jobs) as pool:
            results = run_all(lambda fn, args: pool.imap(fn, args, chunksize=1))
    return [row for rows in results for row in rows]


#: configurations known to have a stack frame (local memory), by name prefix, and why; every
#: other stack frame fails the compile tier, and an entry that no longer has one fails the test
#: that checks this list (so it only shrinks).
KNOWN_STACK = {
    "naive_forward": "by design: the teaching kernel keeps its row of O (HEAD_DIM values) in a "
                     "cuda.local.array indexed in a runtime loop",
    "row_forward": "by design: the second teaching kernel keeps q_i, acc and s in "
                   "cuda.local.array indexed in runtime loops (docs/row-forward.md)",
}


def known_stack(name):
    """The :data:`KNOWN_STACK` entry covering a configuration, or None."""
    return next((k for k in KNOWN_STACK if name.startswith(k)), None)


#: configurations known to spill at 255 registers, by name prefix: ``(LOCAL, why)``, where
#: ``LOCAL`` is the most local-memory instructions (``LDL`` / ``STL``) the counted sm_90
#: iteration may hold (the sm_80 build follows it).  A spill passes only under its entry's
#: budget; any other spill fails the compile tier, and an entry that no longer covers a spilling
#: configuration fails the test that checks this list (so it only shrinks; the suite checks the
#: entries whose builds it makes, the full tier all of them).  No goal configuration of the
#: mainloop issue (32) is here: those spill nothing, and their tests say so.
KNOWN_SPILL = {
    "backward_mma dkdv (dk dv dq) W2 N32 M32 D128 S1 dropout softcap alibi": (
        2, "the d = 128 dK/dV build with every flag (dropout's Philox state beside dK and dV's 2 x "
           "64 accumulators per lane) at 255 registers: 16 B stored, 2 local loads per query "
           "tile (with ptxas 13 the plain d = 128 build spills nothing)"),
    "backward_mma dkdv (dk dv dq) W2 N64 M16 D64 S2 score_mod": (
        6, "the d = 64 dK/dV build of a user's variant (its functions and aux arrays beside the "
           "accumulators) at 255 registers: 28 B stored, 6 local loads per query tile (with "
           "ptxas 13 the plain build spills nothing)"),
    "forward_mma W4 M128 N64 D64 S2 ld16": (
        0, "the d = 64 forward's 16-bit element-load build (d < 64 or unaligned rows) for "
           "sm_80 only: 52 B stored after the loop; with ptxas 13 its sm_90 build spills "
           "nothing"),
}


def known_spill(name):
    """The :data:`KNOWN_SPILL` prefix covering a configuration, or None."""
    return next((k for k in KNOWN_SPILL if name.startswith(k)), None)


def loop_local_ops(row):
    """``LDL`` / ``STL`` in the counted steady-state iteration of an sm_90 row (None without
    the SASS tier's counts)."""
    s = row.get("sass") or {}
    if not s.get("loop"):
        return None
    return s["counts"].get("local", 0)


def problems(row):
    out = []
    if row["ptxas_rc"] != 0:
        err = row["ptxas_err"].strip().splitlines()
        out.append("build failed: " + (err[-1] if err else "ptxas returned non-zero"))
    if row["f64"] and not row["float64_ok"]:
        out.append("float64 instruction in a float16/float32 kernel: " + row["f64"][0])
    if row.get("mma_missing"):
        out.append("no mma.sync in the PTX of a tensor-core kernel (configuration marks mma)")
    spill = row["spill_stores"] or row["spill_loads"]
    known = known_spill(row["name"])
    local = loop_local_ops(row) or 0
    budget = KNOWN_SPILL[known][0] if known is not None else 0
    if spill and (known is None or local > budget):
        out.append(f"spills: {row['spill_stores']} B stores, {row['spill_loads']} B loads")
    if row["stack"] and known_stack(row["name"]) is None and not (spill and known):
        out.append(f"stack frame of {row['stack']} B (local memory)")
    if local > budget and known_stack(row["name"]) is None:
        out.append(f"{local} local-memory instructions in the steady-state loop"
                   + (f" (KNOWN_SPILL allows {budget})" if known else ""))
    if row["smem"] > SMEM_LIMIT:
        out.append(f"static shared memory {row['smem']} B > {SMEM_LIMIT} B")
    return out


def format_table(rows):
    head = (f"{'configuration':58s} {'arch':6s} {'regs':>4s} {'smem B':>7s} {'spill':>5s} "
            f"{'f64':>4s}  status")
    lines = [head, "-" * len(head)]
    for r in rows:
        spill = r["spill_stores"] + r["spill_loads"]
        status = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        lines.append(f"{r['name'][:58]:58s} {r['cc']:6s} {r['registers']:4d} {r['smem']:7d} "
                     f"{spill:5d} {len(r['f64']):4d}  {status}")
    return "\n".join(lines)


#: where the page's part written by ``numba-flash profile --goal-builds`` starts: the
#: resource and SASS tables are rewritten, this part kept
MEMORY_TIER = "\n## Memory tier"


def _kept_tail(path):
    """The part of ``path`` from :data:`MEMORY_TIER` on (the memory tier's tables), or "" ."""
    try:
        with open(path) as fh:
            text = fh.read()
    except OSError:
        return ""
    i = text.find(MEMORY_TIER)
    return "" if i < 0 else text[i:]


def markdown_table(rows, ptxas):
    """The resource table as Markdown, one row per configuration (sm_80 | sm_90 side by side),
    stamped with the tool versions that produced it."""
    from importlib.metadata import version

    ptxas_version = subprocess.run([ptxas, "--version"], capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1]
    by_name = {}
    for r in rows:
        by_name.setdefault(r["name"], {})[r["cc"]] = r
    # every architecture the compile tier targets has its column, whatever subset was built
    ccs = sorted({"sm_80", "sm_89", "sm_90", "sm_90a"} | {r["cc"] for r in rows})
    head = ["configuration"] + [f"{cc} regs" for cc in ccs] + ["smem B", "spill B", "f64", "status"]
    lines = ["# Compile-tier resource table", "",
             "Generated by `python -m numba_flash compile-check --markdown docs/resources.md`; "
             "see [the compile tier](compile-tier.md).", "",
             f"Built {time.strftime('%Y-%m-%d')} with numba {version('numba')}, numba-cuda "
             f"{version('numba-cuda')}, ptxas {ptxas_version}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, per_cc in by_name.items():
        any_row = next(iter(per_cc.values()))
        smem = str(max(r["smem"] for r in per_cc.values()))
        dynamic = max(r.get("dynamic_smem", 0) for r in per_cc.values())
        if dynamic:   # launched with dynamic shared memory (past 48 KiB: opted into)
            smem += f" + {dynamic} dynamic"
        spill = max(r["spill_stores"] + r["spill_loads"] for r in per_cc.values())
        f64 = "yes" if any(r["f64"] for r in per_cc.values()) else "no"
        bad = [p for r in per_cc.values() for p in r["problems"]]
        regs = [str(per_cc[cc]["registers"]) if cc in per_cc else "-" for cc in ccs]
        lines.append("| " + " | ".join([name, *regs, smem, str(spill),
                                         f64 + (" (float64 kernel)" if any_row["float64_ok"] and
                                                f64 == "yes" else ""),
                                         "ok" if not bad else "FAIL: " + "; ".join(bad)]) + " |")
    return "\n".join(lines) + "\n"


SASS_COLUMNS = ("instr/iter", "MMA", "non-MMA/MMA", "FFMA %", "global B/instr", "LDS+LDSM",
                "smem B", "barriers", "int/addr", "issue bound", "smem bound", "ceiling")


def sass_cells(r):
    """The SASS tier's cells of one sm_90 row (see :data:`SASS_COLUMNS`)."""
    s = r.get("sass") or {}
    if not s.get("loop"):
        return ["no loop"] + ["-"] * (len(SASS_COLUMNS) - 1)
    c = s["counts"]
    lds = sum(v for k, v in c.items() if k.startswith(("lds", "ldsm")))
    if s["mma"]:
        ceiling = f"{s['ceiling_tflops']:.0f} TFLOP/s" + (" (mma)" if s.get("bound") == "mma.sync"
                                                        else "")
    elif s.get("streaming"):
        # a streaming kernel (decode): bytes bound it, and past the HBM's bandwidth the HBM does
        hbm = sass.H200["hbm_gbs"]
        ceiling = (f"{s['ceiling_gbs']:.0f} GB/s" if s["ceiling_gbs"] < hbm
                   else f"{hbm:.0f} GB/s (HBM)")
    else:
        ceiling = f"{s['ceiling_tflops']:.1f} TFLOP/s"
    lower = "" if s["trips_known"] else " (>=)"
    flops = not s.get("streaming") and (s["mma"] or c.get("ffma"))
    issue = f"{s['issue_tflops']:.0f}" if flops and "issue_tflops" in s else "-"
    smem = (f"{s['smem_tflops']:.0f}" if flops and s.get("smem_tflops") is not None else "-")
    return [f"{s['instructions']}{lower}", str(s["mma"]),
            "-" if s["non_mma_per_mma"] is None else f"{s['non_mma_per_mma']:.1f}",
            f"{100 * s['ffma_share']:.0f}", f"{s['bytes_per_instruction']:.2f}", str(lds),
            str(s.get("shared_bytes", "-")), str(c.get("barrier", 0)), str(c.get("int_addr", 0)),
            issue, smem, ceiling]


def format_sass_table(rows):
    sass_rows = [r for r in rows if "sass" in r]
    head = f"{'configuration (sm_90, per warp per iteration)':58s} " + " ".join(
        f"{h:>11s}" for h in SASS_COLUMNS)
    lines = [head, "-" * len(head)]
    for r in sass_rows:
        lines.append(f"{r['name'][:58]:58s} " + " ".join(f"{c:>11s}" for c in sass_cells(r)))
    return "\n".join(lines)


def sass_markdown(rows):
    """The SASS table as Markdown (appended to the resource table)."""
    lines = ["", "## SASS tier: one steady-state iteration on sm_90", "",
             "Per warp, one iteration of the loop holding the kernel's work (the K/V-tile loop of "
             "an attention kernel), counted from ptxas + nvdisasm output by "
             "`numba_flash.tools.sass` (`python -m numba_flash compile-check --sass`; "
             "`--dump NAME` shows the code). "
             "Ceiling: an H200 issuing one instruction per scheduler per clock "
             f"({sass.H200['sms']} SMs x {sass.H200['schedulers']} x "
             f"{sass.H200['clock_hz'] / 1e9:.2f} GHz) times the useful work per instruction "
             "(MMA or FFMA flops, or for a streaming kernel the bytes of all its global loads, "
             "K/V and block table alike); `(mma)`: above the "
             f"~{sass.MMA_SYNC_TFLOPS:.0f} TFLOP/s mma.sync itself reaches, so that bound; "
             f"`(HBM)`: above the {sass.H200['hbm_gbs']:.0f} GB/s of HBM, so that bound. "
             "issue bound: the same without the mma.sync cap (TFLOP/s); smem B: bytes the warp "
             "reads from shared memory in the iteration (ldmatrix.x4 512 B, LDS.w 32w B); smem "
             f"bound: flops per shared byte x {sass.SMEM_BYTES_PER_CLK} B per clock per SM "
             "(TFLOP/s; a broadcast read counts in full, so a lower bound for kernels whose lanes "
             "share addresses). "
             "`(>=)`: an inner loop "
             "the compiler did not unroll is counted once, so the count is a lower bound. "
             "The e4m3 forward's rows (`forward_fp8`) count sm_89's code, its native e4m3 "
             "mma.sync (`QMMA.16832`, 8192 flops; Hopper has none: ptxas turns it into e4m3 "
             "conversions and HMMA.16816), at the H200's issue rate as the yardstick and "
             "without a cap; the e4m3 warpgroup forward's (`forward_wgmma_fp8`, sm_90a) count "
             "e4m3 `QGMMA.64xNx32` flops, capped at the H200's e4m3 wgmma peak "
             f"({sass.WGMMA_FP8_TFLOPS:.0f} TFLOP/s).", "",
             "| configuration | " + " | ".join(SASS_COLUMNS) + " |",
             "|---|" + "---|" * len(SASS_COLUMNS)]
    for r in rows:
        if "sass" in r:
            lines.append("| " + " | ".join([r["name"], *sass_cells(r)]) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    global _DUMP
    ap = argparse.ArgumentParser(prog="numba-flash compile-check",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="80,90", help="compute capabilities, e.g. 80,90")
    ap.add_argument("--json", help="write the rows as JSON to this file")
    ap.add_argument("--markdown", help="write the resource table as Markdown to this file")
    ap.add_argument("-k", dest="selector", help="only configurations whose name contains this")
    ap.add_argument("--suite", action="store_true",
                    help="only the test suite's selection (compile_check.in_suite)")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count() or 1,
                    help="parallel build processes (default: all cores)")
    ap.add_argument("--sass", action="store_true",
                    help="also count one steady-state loop iteration of each sm_90 build")
    ap.add_argument("--cache", metavar="DIR",
                    help="keep each build's rows under DIR, keyed by the package's sources and "
                         "the toolchain's versions, and take them from there next time")
    ap.add_argument("--dump", metavar="NAME",
                    help="print the sm_90 SASS of configurations whose name contains NAME, "
                         "the counted loop marked '>' (implies --sass)")
    args = ap.parse_args(argv)
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("0",):
        print("set NUMBA_ENABLE_CUDASIM=0: the compile tier needs the real CUDA target",
              file=sys.stderr)
        return 2
    tools = ["ptxas", "nvdisasm"] if args.sass or args.dump else ["ptxas"]
    missing = [m for m in map(missing_wheel_tool, tools) if m]
    if missing:  # one line, before any work: a ptxas on PATH is another toolchain
        print(f"numba-flash compile-check: error: {missing[0]}", file=sys.stderr)
        return 2
    ptxas = wheel_tool("ptxas")
    ccs = [(int(c[0]), int(c[1:])) for c in args.cc.split(",")]
    nvdisasm = None
    if args.sass or args.dump:
        nvdisasm = wheel_tool("nvdisasm")
        if SASS_CC not in ccs:
            ccs.append(SASS_CC)
    _DUMP = args.dump
    cache = BuildCache(args.cache) if args.cache and not args.dump else None  # dump: listings
    rows = build_all(list(all_configs(args.selector, args.suite)), ccs, ptxas, args.jobs,
                     nvdisasm, progress=progress_bar, cache=cache)
    for r in rows:
        if "sass_listing" in r:
            print(f"== {r['name']} (sm_90), counted loop {r['sass'].get('loop')}")
            print(sass.mark_loop(r.pop("sass_listing"), r["sass"].get("loop")))
    print(format_table(rows))
    if nvdisasm:
        print()
        print(format_sass_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    if args.markdown:
        kept = _kept_tail(args.markdown)
        with open(args.markdown, "w") as fh:
            fh.write(markdown_table(rows, ptxas) + (sass_markdown(rows) if nvdisasm else "")
                     + kept)
    return 1 if any(r["problems"] for r in rows) else 0


def run(argv=None):
    """:func:`main` as a command: a closed pipe (``compile-check | head -1``) ends quietly with
    status 0, as the other commands do."""
    try:
        status = main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError:  # the reader went away: stdout to /dev/null for the last flush
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(run())
