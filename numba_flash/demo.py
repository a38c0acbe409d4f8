"""The main job: run every capability on a small problem, check it against the float64
reference and print a table.  ``python -m numba_flash demo --help`` lists the options.

Each case builds fresh random inputs, runs the kernel on the available backend (GPU or the
simulator), runs :mod:`numba_flash.reference` in float64 on the same inputs, and reports the max
absolute error, the error relative to the largest reference value, the kernel time and OK/FAIL.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import numba_flash
from numba_flash import reference as ref

#: max abs error allowed, relative to max(1, max |reference|), per dtype.  Far above the errors
#: the kernel tests measure (see tests/), far below what a wrong kernel produces (O(1)).
TOLERANCE = {"float16": 1e-2, "bfloat16": 5e-2, "float32": 1e-4, "float64": 1e-10}

#: problem sizes: (B, H, Hkv, N, d).  "tiny" suits the simulator, "gpu" a real device.
SIZES = {
    "tiny": dict(B=1, H=2, Hkv=1, N=24, d=16, ctx=40, block_size=4),
    "small": dict(B=2, H=4, Hkv=2, N=48, d=32, ctx=96, block_size=8),
    "gpu": dict(B=4, H=16, Hkv=4, N=1024, d=64, ctx=8192, block_size=16),
}


@dataclass
class Row:
    op: str
    shape: str
    errors: list = field(default_factory=list)  # (got, want) pairs
    seconds: float = 0.0
    dtype: str = "float32"
    note: str = ""

    def max_abs(self):
        return max(float(np.max(np.abs(np.asarray(g, np.float64) - w), initial=0.0))
                   for g, w in self.errors)

    def max_ref(self):
        return max(float(np.max(np.abs(w), initial=0.0)) for _, w in self.errors)

    def ok(self):
        if any(np.isnan(np.asarray(g, np.float64)).any() for g, _ in self.errors):
            return False
        return self.max_abs() <= TOLERANCE[self.dtype] * max(1.0, self.max_ref())


def _console():
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self):
            """A closed pipe (``demo | head -1``) reaches the command line as the
            BrokenPipeError it is, which ends quietly with status 0 (rich's own answer is
            ``SystemExit(1)``)."""
            self.quiet = True
            raise BrokenPipeError(32, "Broken pipe")

    console = PipeConsole()
    if not console.is_terminal:  # a log or a pipe: wide enough for one line per row
        console = PipeConsole(width=150)
    return console


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _finite(x):
    x = np.asarray(x, np.float64)
    return np.where(np.isinf(x), 0.0, x)


def _qkv(rng, s, dtype, nk=None):
    nk = s["N"] if nk is None else nk
    q = rng.standard_normal((s["B"], s["H"], s["N"], s["d"])).astype(dtype)
    k = rng.standard_normal((s["B"], s["Hkv"], nk, s["d"])).astype(dtype)
    v = rng.standard_normal((s["B"], s["Hkv"], nk, s["d"])).astype(dtype)
    return q, k, v


def case_softmax(rng, s, dtype):
    x = (rng.standard_normal((s["B"] * s["H"], s["N"])) * 4).astype(dtype)
    y, t = _timed(lambda: numba_flash.softmax(x))
    want = np.stack([ref.softmax(r) for r in x.astype(np.float64)])
    return Row("softmax", f"x{list(x.shape)}", [(y, want)], t, dtype)


def _forward(rng, s, dtype, causal):
    q, k, v = _qkv(rng, s, dtype)
    (o, lse), t = _timed(lambda: numba_flash.forward(q, k, v, causal=causal, return_lse=True))
    o_ref, lse_ref = ref.attention(q, k, v, causal=causal)
    name = "forward causal" if causal else "forward"
    return Row(name, _shape(s), [(o, o_ref), (_finite(lse), _finite(lse_ref))], t, dtype)


def case_forward(rng, s, dtype):
    return _forward(rng, s, dtype, False)


def case_forward_causal(rng, s, dtype):
    return _forward(rng, s, dtype, True)


def case_backward(rng, s, dtype):
    q, k, v = _qkv(rng, s, dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    o, lse = numba_flash.forward(q, k, v, causal=True, return_lse=True)
    (dq, dk, dv), t = _timed(lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True))
    want = ref.attention_backward(do, q, k, v, causal=True)
    return Row("backward causal", _shape(s), list(zip((dq, dk, dv), want)), t, dtype)


def case_dropout(rng, s, dtype):
    q, k, v = _qkv(rng, s, dtype)
    p, seed = 0.2, 1234
    keep = numba_flash.dropout_mask(seed, s["B"], s["H"], s["N"], s["N"], p)
    (o, lse), t = _timed(lambda: numba_flash.forward(q, k, v, causal=True, dropout_p=p,
                                                     seed=seed, return_lse=True))
    o_ref, _ = ref.attention(q, k, v, causal=True, dropout_mask=keep, dropout_p=p)
    do = rng.standard_normal(q.shape).astype(dtype)
    (dq, dk, dv), t2 = _timed(lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True,
                                                           dropout_p=p, seed=seed))
    want = ref.attention_backward(do, q, k, v, causal=True, dropout_mask=keep, dropout_p=p)
    return Row("dropout fwd+bwd", _shape(s) + f" p={p}", [(o, o_ref), *zip((dq, dk, dv), want)],
               t + t2, dtype)


def case_variants(rng, s, dtype):
    """Sliding window, softcap and ALiBi together, forward and backward (GQA as the size has)."""
    q, k, v = _qkv(rng, s, dtype)
    kw = dict(causal=True, window_size=(s["N"] // 3, 0), softcap=5.0,
              alibi_slopes=ref.alibi_slopes(s["H"]))
    do = rng.standard_normal(q.shape).astype(dtype)
    (o, lse), t = _timed(lambda: numba_flash.forward(q, k, v, return_lse=True, **kw))
    (dq, dk, dv), t2 = _timed(lambda: numba_flash.backward(do, q, k, v, o, lse, **kw))
    o_ref, _ = ref.attention(q, k, v, **kw)
    want = ref.attention_backward(do, q, k, v, **kw)
    return Row("window+softcap+ALiBi fwd+bwd", _shape(s) + f" window=({s['N'] // 3}, 0)",
               [(o, o_ref), *zip((dq, dk, dv), want)], t + t2, dtype)


def case_varlen(rng, s, dtype):
    """A packed batch of three sequences of different lengths, queries and keys."""
    lens_q, lens_k = [s["N"] // 2, 1, s["N"]], [s["N"] // 2, s["N"] // 3, s["N"]]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), s["H"], s["d"])).astype(dtype)
    k = rng.standard_normal((int(cu_k[-1]), s["Hkv"], s["d"])).astype(dtype)
    v = rng.standard_normal(k.shape).astype(dtype)
    do = rng.standard_normal(q.shape).astype(dtype)
    kw = dict(max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k), causal=True)
    (o, lse), t = _timed(lambda: numba_flash.forward_varlen(q, k, v, cu_q, cu_k, return_lse=True,
                                                            **kw))
    (dq, dk, dv), t2 = _timed(lambda: numba_flash.backward_varlen(do, q, k, v, o, lse, cu_q, cu_k,
                                                                  **kw))
    o_ref, _ = ref.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    want = ref.attention_backward_varlen(do, q, k, v, cu_q, cu_k, causal=True)
    return Row("varlen fwd+bwd causal", f"q{list(q.shape)} lengths q={lens_q} k={lens_k}",
               [(o, o_ref), *zip((dq, dk, dv), want)], t + t2, dtype)


def case_tensor_cores(rng, s, dtype):
    """The float16 tensor-core (mma.sync) kernels, whatever --dtype says (they are float16 only;
    in the simulator the mma runs as a lane-by-lane twin)."""
    q, k, v = _qkv(rng, s, np.float16)
    do = rng.standard_normal(q.shape).astype(np.float16)
    (o, lse), t = _timed(lambda: numba_flash.forward(q, k, v, causal=True, return_lse=True,
                                                     kernel="mma"))
    (dq, dk, dv), t2 = _timed(lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True,
                                                           kernel="mma"))
    o_ref, _ = ref.attention(q, k, v, causal=True)
    want = ref.attention_backward(do, q, k, v, causal=True)
    return Row("tensor cores fwd+bwd causal", _shape(s), [(o, o_ref), *zip((dq, dk, dv), want)],
               t + t2, "float16")


def case_bfloat16(rng, s, dtype):
    """bfloat16 (``ml_dtypes.bfloat16``) in and out, whatever --dtype says: the causal forward
    on both kernel families (SIMT, tensor cores) and the backward (the default kernel)."""
    import ml_dtypes

    bf16 = ml_dtypes.bfloat16
    q, k, v = _qkv(rng, s, bf16)
    do = rng.standard_normal(q.shape).astype(bf16)
    (o, lse), t = _timed(lambda: numba_flash.forward(q, k, v, causal=True, return_lse=True,
                                                     kernel="simt"))
    o_mma, t1 = _timed(lambda: numba_flash.forward(q, k, v, causal=True, kernel="mma"))
    (dq, dk, dv), t2 = _timed(lambda: numba_flash.backward(do, q, k, v, o, lse, causal=True))
    if not all(x.dtype == bf16 for x in (o, o_mma, dq, dk, dv)):
        raise TypeError("expected bfloat16 outputs")
    o_ref, _ = ref.attention(q, k, v, causal=True)
    want = ref.attention_backward(do, q, k, v, causal=True)
    return Row("bfloat16 fwd (simt, mma) + bwd", _shape(s),
               [(o, o_ref), (o_mma, o_ref), *zip((dq, dk, dv), want)], t + t1 + t2, "bfloat16")


def _cache(rng, s, dtype):
    b, hkv, d, ctx = s["B"], s["Hkv"], s["d"], s["ctx"]
    seqlens = np.array([max(1, ctx - 7 * i) for i in range(b)], np.int32)
    k = rng.standard_normal((b, hkv, ctx, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, ctx, d)).astype(dtype)
    q = rng.standard_normal((b, s["H"], d)).astype(dtype)
    return q, k, v, seqlens


def case_decode(rng, s, dtype):
    q, k, v, seqlens = _cache(rng, s, dtype)
    o, t = _timed(lambda: numba_flash.decode(q, k, v, cache_seqlens=seqlens))
    o_ref, _ = ref.paged_decode(q, k, v, seqlens)
    return Row("decode contiguous", f"q{list(q.shape)} cache{list(k.shape)}", [(o, o_ref)], t,
               dtype)


def case_paged_decode(rng, s, dtype):
    q, k, v, seqlens = _cache(rng, s, dtype)
    bs = s["block_size"]
    nblk = -(-s["ctx"] // bs)
    table = rng.permutation(q.shape[0] * nblk).reshape(q.shape[0], nblk).astype(np.int32)
    kc = np.zeros((table.size, k.shape[1], bs, k.shape[3]), dtype)
    vc = np.zeros_like(kc)
    for b in range(q.shape[0]):
        for t in range(int(seqlens[b])):
            kc[table[b, t // bs], :, t % bs] = k[b, :, t]
            vc[table[b, t // bs], :, t % bs] = v[b, :, t]
    splits = 3
    o, t = _timed(lambda: numba_flash.decode(q, kc, vc, cache_seqlens=seqlens,
                                              block_table=table, num_splits=splits))
    o_ref, _ = ref.paged_decode(q, kc, vc, seqlens, table)
    return Row("paged decode split-KV", f"q{list(q.shape)} blocks{list(kc.shape)} splits={splits}",
               [(o, o_ref)], t, dtype)


def _shape(s):
    return f"B={s['B']} H={s['H']} Hkv={s['Hkv']} N={s['N']} d={s['d']}"


CASES = {
    "softmax": case_softmax,
    "forward": case_forward,
    "causal": case_forward_causal,
    "backward": case_backward,
    "dropout": case_dropout,
    "variants": case_variants,
    "varlen": case_varlen,
    "mma": case_tensor_cores,
    "bfloat16": case_bfloat16,
    "decode": case_decode,
    "paged": case_paged_decode,
}


def run(ops, size="tiny", dtype="float32", seed=0, console=None):
    """Run the chosen cases; return the rows (with errors caught as FAIL rows)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or _console()
    s = SIZES[size]
    rows = []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(ops))
        for name in ops:
            progress.update(task, description=f"{name} ({numba_flash.backend()})")
            rng = np.random.default_rng(seed)
            try:
                row = CASES[name](rng, s, dtype)
            except Exception as exc:  # reported as a FAIL row, the rest still runs
                row = Row(name, _shape(s), [], 0.0, dtype, note=f"{type(exc).__name__}: {exc}")
            rows.append(row)
            progress.advance(task)
    return rows


def render(rows, console=None):
    """Print the results table; return True when every row is OK."""
    from rich.table import Table

    console = console or _console()
    table = Table(title=f"numba_flash demo on the {numba_flash.backend()} backend "
                        "(errors against the float64 reference)")
    for col, just in (("operation", "left"), ("shape", "left"), ("backend", "left"),
                      ("dtype", "left"), ("max abs err", "right"), ("rel err", "right"),
                      ("time", "right"), ("status", "center")):
        table.add_column(col, justify=just)
    all_ok = True
    for r in rows:
        if r.errors:
            ok = r.ok()
            mx, rel = r.max_abs(), r.max_abs() / max(r.max_ref(), 1e-300)
            cells = (f"{mx:.2e}", f"{rel:.2e}", f"{r.seconds * 1e3:.0f} ms")
        else:
            ok, cells = False, ("-", "-", "-")
        all_ok &= ok
        status = "[green]OK[/green]" if ok else "[red]FAIL[/red]"
        table.add_row(r.op, r.shape, numba_flash.backend(), r.dtype, *cells, status)
    console.print(table)
    for r in rows:
        if r.note:
            console.print(f"[red]{r.op}[/red]: {r.note}")
    if numba_flash.backend() == "simulator":
        console.print("Times are simulator times (one Python thread per CUDA thread), not GPU "
                      "speed; see bench/ and docs/performance.md.")
    return all_ok
