"""The fp8 forward's error table (docs/fp8.md): how far e4m3 attention lands from float64.

    python bench/fp8_errors.py [--json FILE]

For three kinds of logits, the largest ``|o - ref| / max |v|`` and ``|lse - ref|`` of:

* ``fp8``: ``numba_flash.forward`` on e4m3 ``q``, ``k``, ``v`` with descales (the shipped
  build: ``P`` packed as ``P 2**4``, the lazy rescale's threshold 4);
* ``fp8, P unscaled``: the same kernel built with ``P_OFFSET = 0`` (``P`` cast as it is);
* ``fp8, P clipped``: built with ``P_OFFSET = 8`` over the threshold 4 (FA4's first fp8 build:
  a packed ``P`` up to 2**12, saturated at 448);
* ``bfloat16``: the 16-bit forward on the same values in bfloat16 (no e4m3 rounding of ``P``).

The reference is :func:`numba_flash.reference.attention` in float64 on the dequantised inputs
(e4m3 values times their descales), so every column measures the kernel, not the input
quantisation.  Logits: ``unit`` (q, k, v standard normal), ``wide`` (q x 20, the issue's case),
``rising`` (scores that rise by 1 from one 64-key tile to the next, a value per tile: the
running max lags by less than the threshold).  Then the rotation table: ``quantize_e4m3`` with
and without ``rotate=True`` end to end (:func:`rotation_table`).  d = 64, B = 1, H = 2, Nq =
16, Nk = 192, seed 0;
the Numba CUDA simulator on a CPU (the twin of ``mma.sync.m16n8k32``: exact e4m3 products,
float32 sums), or the GPU when one is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import numpy as np
from ml_dtypes import bfloat16, float8_e4m3fn

import numba_flash
import numba_flash.ops.forward_fp8 as forward_fp8_op
from numba_flash import reference as ref

E4M3 = float8_e4m3fn
SHIPPED = forward_fp8_op.forward_fp8_config


def inputs(kind, rng, h=2, nq=16, nk=192, d=64):
    q = rng.standard_normal((1, h, nq, d)) * (20.0 if kind == "wide" else 1.0)
    k = rng.standard_normal((1, 1, nk, d))
    v = rng.standard_normal((1, 1, nk, d))
    if kind == "rising":
        tile = np.arange(nk) // 64
        q = q * 0.005
        q[..., 0] = 8.0
        k[..., 0] = 3.0 + tile
        v[:] = (2.0 * (tile - 1))[:, None]
    q, k, v = (x.astype(E4M3) for x in (q, k, v))
    scales = [rng.uniform(0.5, 2.0, (1, 1)).astype(np.float32) for _ in range(3)]
    if kind == "rising":
        scales = [np.ones((1, 1), np.float32) for _ in range(3)]
    return q, k, v, scales


def dequantised(q, k, v, scales):
    return tuple(x.astype(np.float64) * s[:, :, None, None] for x, s in zip((q, k, v), scales))


def errors(o, lse, want_o, want_lse, vmax):
    return (float(np.abs(np.asarray(o, np.float64) - want_o).max() / vmax),
            float(np.abs(np.asarray(lse, np.float64) - want_lse).max()))


def fp8_run(q, k, v, scales, p_offset=None):
    if p_offset is not None:
        forward_fp8_op.forward_fp8_config = (
            lambda *a, **kw: dataclasses.replace(SHIPPED(*a, **kw), P_OFFSET=p_offset))
    try:
        return numba_flash.forward(q, k, v, q_descale=scales[0], k_descale=scales[1],
                                   v_descale=scales[2], return_lse=True)
    finally:
        forward_fp8_op.forward_fp8_config = SHIPPED


def table():
    rows = []
    for kind in ("unit", "wide", "rising"):
        rng = np.random.default_rng(0)
        q, k, v, scales = inputs(kind, rng)
        qf, kf, vf = dequantised(q, k, v, scales)
        want_o, want_lse = ref.attention(qf, kf, vf)
        vmax = np.abs(vf).max()
        row = {"logits": kind}
        for name, offset in (("fp8", None), ("fp8, P unscaled", 0), ("fp8, P clipped", 8)):
            row[name] = errors(*fp8_run(q, k, v, scales, offset), want_o, want_lse, vmax)
        o16, lse16 = numba_flash.forward(*(x.astype(bfloat16) for x in (qf, kf, vf)),
                                         return_lse=True, kernel="mma")
        row["bfloat16"] = errors(o16, lse16, want_o, want_lse, vmax)
        rows.append(row)
    return rows


def rotation_table(outliers=(10.0, 100.0)):
    """RMSE of ``o`` against float64 attention on the float inputs, through
    :func:`numba_flash.quantize_e4m3` (input rounding included) and the fp8 forward, with and
    without the Hadamard rotation: q, k, v standard normal with 0.1 % of the q and k entries
    drawn ``outlier`` times wider (FA3's setting of its incoherent-processing figure)."""
    rows = []
    for outlier in outliers:
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal(s) for s in ((1, 2, 16, 64), (1, 1, 192, 64),
                                                     (1, 1, 192, 64)))
        for x in (q, k):
            where = rng.random(x.shape) < 0.001
            x[where] = rng.standard_normal(int(where.sum())) * outlier
        want, _ = ref.attention(q, k, v)
        row = {"outliers": outlier}
        for rotate in (False, True):
            q8, k8, v8, qd, kd, vd = numba_flash.quantize_e4m3(q, k, v, rotate=rotate)
            o = numba_flash.forward(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
            row["rotate" if rotate else "plain"] = float(
                np.sqrt(((np.asarray(o, np.float64) - want) ** 2).mean()))
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args()
    rows = table()
    cols = ("fp8", "fp8, P unscaled", "fp8, P clipped", "bfloat16")
    print("| logits | " + " | ".join(f"{c}: o / lse" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in rows:
        print(f"| {r['logits']} | " + " | ".join(f"{r[c][0]:.2%} / {r[c][1]:.1e}" for c in cols)
              + " |")
    rot = rotation_table()
    print()
    print("| 0.1 % of q, k entries | RMSE of o, plain | with rotate=True |")
    print("|---|---|---|")
    for r in rot:
        print(f"| x {r['outliers']:.0f} | {r['plain']:.2e} | {r['rotate']:.2e} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": rows, "rotation": rot}, f, indent=1)


if __name__ == "__main__":
    main()
