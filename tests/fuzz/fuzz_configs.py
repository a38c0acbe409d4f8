"""Seeded random configurations for tests/fuzz/test_random_configs.py (issue 59).

A configuration is a plain dict of Python values (shapes, options, a data seed); each op has a
generator ``<op>(rng) -> dict`` that draws one valid configuration, and :func:`cases` turns the
first ``n`` draws of an op into pytest params whose id prints the whole configuration
(:func:`describe`).  Case ``i`` of an op draws from ``default_rng([seed, op number, i])``, so the
default cases are a prefix of any longer run with the same seed, and a failing id reproduces
with the same ``NUMBA_FLASH_FUZZ_SEED``.

Shapes are tiny (the simulator runs a Python thread per CUDA thread): sequence lengths up to 20,
head dims up to 32, at most 4 query heads.  ``NUMBA_FLASH_FUZZ_MAX_N=N`` draws lengths up to ``N``
instead (more tiles: the tensor-core kernels' 32-row tiles need N > 32; slow), a hand-run knob
that a failing id needs again to reproduce.
"""

from __future__ import annotations

import os

import numpy as np

#: the default number of cases per op (tests/fuzz runs in about a minute on one core); the
#: environment variable NUMBA_FLASH_FUZZ_CASES=N runs N cases of every op instead
DEFAULT_CASES = {"forward": 12, "backward": 7, "varlen": 8, "decode": 14, "merge": 10,
                 "flex": 5, "torch": 4, "kvcache": 6}

#: the op numbers in the seed of each case (a new op takes a new number: the others keep theirs)
OP_NUMBER = {"forward": 1, "backward": 2, "varlen": 3, "decode": 4, "merge": 5, "flex": 6,
             "torch": 7, "kvcache": 8}

DTYPES = ("float16", "bfloat16", "float32", "float64")
TENSOR_CORE_DTYPES = ("float16", "bfloat16")


def env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def base_seed():
    """``NUMBA_FLASH_FUZZ_SEED`` (default 0): another seed draws other configurations."""
    return env_int("NUMBA_FLASH_FUZZ_SEED", 0)


def max_n():
    """``NUMBA_FLASH_FUZZ_MAX_N`` (default 20): the longest sequence the generators draw."""
    return env_int("NUMBA_FLASH_FUZZ_MAX_N", 20)


def n_cases(op):
    """``NUMBA_FLASH_FUZZ_CASES`` if set, else :data:`DEFAULT_CASES`."""
    return env_int("NUMBA_FLASH_FUZZ_CASES", DEFAULT_CASES[op])


# ----------------------------------------------------------------------------------------------
# pieces shared by several ops
# ----------------------------------------------------------------------------------------------
def _chance(rng, p):
    return bool(rng.random() < p)


def _heads(rng, max_h=4):
    """``(H, Hkv)``: Hkv in 1..2, a group of 1..3 query heads a kv head (H <= max_h)."""
    while True:
        hkv = int(rng.integers(1, 3))
        group = int(rng.integers(1, 4))
        if hkv * group <= max_h:
            return hkv * group, hkv


def _head_dim(rng, lo=1, hi=32):
    """A head dim, mostly not a power of two."""
    if _chance(rng, 0.25):
        return int(rng.choice([x for x in (1, 2, 4, 8, 16, 32) if lo <= x <= hi]))
    return int(rng.integers(lo, hi + 1))


def _lengths(rng):
    """``(Nq, Nk)`` in 1..max_n(): independent, so Nq > Nk (rows that see no key under causal)
    is common."""
    return int(rng.integers(1, max_n() + 1)), int(rng.integers(1, max_n() + 1))


def _window(rng, nq, nk):
    """A ``window_size`` (left, right): each side -1 (unbounded) or 0..past the sequence."""
    def side(n):
        return -1 if _chance(rng, 0.3) else int(rng.integers(0, n + 3))
    return (side(nk), side(nq))


def _sink_pattern(rng, h):
    """A string of one letter per query head: ``r`` a random finite logit, ``i`` -inf."""
    return "".join("i" if _chance(rng, 0.35) else "r" for _ in range(h))


def _variants(rng, cfg, nq, nk, dropout=True):
    """The attention variants every dense op takes, into ``cfg``."""
    cfg["causal"] = _chance(rng, 0.35)
    cfg["window"] = _window(rng, nq, nk) if _chance(rng, 0.35) else (-1, -1)
    cfg["softcap"] = round(float(rng.uniform(0.5, 8.0)), 2) if _chance(rng, 0.25) else 0.0
    cfg["alibi"] = str(rng.choice(["H", "BH"])) if _chance(rng, 0.25) else ""
    cfg["sink"] = _sink_pattern(rng, cfg["H"]) if _chance(rng, 0.3) else ""
    cfg["scale"] = round(float(rng.uniform(0.1, 1.5)), 3) if _chance(rng, 0.15) else None
    cfg["p"] = round(float(rng.choice([0.1, 0.25, 0.4, 0.6])), 2) if (
        dropout and _chance(rng, 0.25)) else 0.0


#: the flex functions the fuzzer draws from (defined in the test module)
SCORE_MODS = ("", "rel_bias", "quad", "head_scale", "neg_dist")
MASK_MODS = ("", "document", "prefix_lm", "stripes", "head_band")


def _data_seed(rng):
    return int(rng.integers(0, 2**31))


# ----------------------------------------------------------------------------------------------
# the generators, one per op
# ----------------------------------------------------------------------------------------------
def forward(rng):
    """``numba_flash.forward``: every dtype, SIMT or tensor cores, every variant."""
    dtype = str(rng.choice(DTYPES))
    kernel = str(rng.choice(["simt", "mma"])) if dtype in TENSOR_CORE_DTYPES else "simt"
    h, hkv = _heads(rng)
    nq, nk = _lengths(rng)
    cfg = dict(dtype=dtype, kernel=kernel, B=int(rng.integers(1, 3)), H=h, Hkv=hkv, Nq=nq,
               Nk=nk, d=_head_dim(rng))
    cfg["dv"] = _head_dim(rng) if _chance(rng, 0.12) else cfg["d"]
    _variants(rng, cfg, nq, nk)
    cfg["qmag"] = float(rng.choice([1.0, 1.0, 2.0]))     # q's scale: sharper softmax rows
    cfg["seed"] = _data_seed(rng)
    return cfg


def backward(rng):
    """``numba_flash.backward`` from the forward's ``o`` and ``lse``: atomic or deterministic
    dQ (``repeat``: the deterministic backward twice, bitwise equal)."""
    cfg = forward(rng)
    cfg["B"] = 1 if _chance(rng, 0.5) else cfg["B"]
    cfg["det"] = _chance(rng, 0.5)
    cfg["repeat"] = cfg["det"] and _chance(rng, 0.5)
    return cfg


def varlen(rng):
    """``forward_varlen`` / ``backward_varlen``: random lengths, some sequences with no queries
    or no keys (never all of them empty), paged K/V (``paged``: the prefill over a paged cache,
    bitwise the packed call), a one-sequence batch against the dense ops (``dense``), a user's
    ``score_mod`` / ``mask_mod``."""
    dtype = str(rng.choice(DTYPES))
    h, hkv = _heads(rng)
    n_seq = int(rng.integers(1, 4))
    while True:
        hi = max_n() * 4 // 5 + 1    # 16 by default
        lq = [0 if _chance(rng, 0.15) else int(rng.integers(1, hi)) for _ in range(n_seq)]
        lk = [0 if _chance(rng, 0.15) else int(rng.integers(1, hi)) for _ in range(n_seq)]
        if sum(lq) > 0 and sum(lk) > 0:
            break
    cfg = dict(dtype=dtype, H=h, Hkv=hkv, lq=tuple(lq), lk=tuple(lk), d=_head_dim(rng))
    cfg["maxq"] = max(lq) + (int(rng.integers(0, 4)) if _chance(rng, 0.3) else 0)
    cfg["maxk"] = max(lk) + (int(rng.integers(0, 4)) if _chance(rng, 0.3) else 0)
    _variants(rng, cfg, max(lq), max(lk))
    cfg["B"] = n_seq
    cfg["det"] = _chance(rng, 0.5)
    cfg["paged"] = int(rng.choice([1, 3, 4, 8])) if _chance(rng, 0.3) else 0   # block size
    cfg["dense"] = n_seq == 1 and lq[0] > 0 and lk[0] > 0
    # a user's functions (as the flex op's; b the sequence, positions within it), no block mask
    cfg["score_mod"] = str(rng.choice(SCORE_MODS[1:])) if _chance(rng, 0.15) else ""
    cfg["mask_mod"] = str(rng.choice(MASK_MODS[1:])) if _chance(rng, 0.15) else ""
    cfg["seed"] = _data_seed(rng)
    return cfg


def decode(rng):
    """``numba_flash.decode``: contiguous or paged (shuffled pages, stale slots NaN), lengths
    including 0, splits, GQA, variants, sinks, ``k_new`` appended to copies, ``cache_leftpad``;
    ``alone``: one sequence alone against its row of the batch, ``both``: the paged and the
    contiguous cache of the same tokens (both bitwise equal); ``batch_idx``: ``cache_batch_idx``
    into a cache of ``B + batch_idx - 1`` rows; a user's ``score_mod`` / ``mask_mod``."""
    dtype = str(rng.choice(DTYPES))
    h, hkv = _heads(rng)
    b = int(rng.integers(1, 4))
    nmax = int(rng.integers(1, max_n() + 1))
    lens = [0 if _chance(rng, 0.15) else int(rng.integers(1, nmax + 1)) for _ in range(b)]
    nnew = int(rng.integers(1, 4)) if _chance(rng, 0.3) else 0
    nmax += nnew
    nq = int(rng.integers(1, 4))
    cfg = dict(dtype=dtype, B=b, H=h, Hkv=hkv, Nq=nq, q3d=nq == 1 and _chance(rng, 0.5),
               d=_head_dim(rng), Nmax=nmax, lens=tuple(lens), new=nnew)
    cfg["paged"] = int(rng.choice([1, 2, 3, 4, 8])) if _chance(rng, 0.5) else 0
    cfg["splits"] = None if _chance(rng, 0.4) else int(rng.integers(1, 6))
    cfg["leftpad"] = _chance(rng, 0.15)
    _variants(rng, cfg, nq, nmax, dropout=False)
    cfg["alone"] = b > 1 and _chance(rng, 0.4)
    cfg["both"] = _chance(rng, 0.3)
    # cache_batch_idx: the sequences' rows of a contiguous cache with 0..2 spare rows, shuffled
    cfg["batch_idx"] = (int(rng.integers(0, 3)) + 1 if not cfg["paged"] and not cfg["both"]
                        and _chance(rng, 0.25) else 0)
    # a user's functions (as the flex op's): decode takes them, without a block mask
    cfg["score_mod"] = str(rng.choice(SCORE_MODS[1:])) if _chance(rng, 0.15) else ""
    cfg["mask_mod"] = str(rng.choice(MASK_MODS[1:])) if _chance(rng, 0.15) else ""
    cfg["seed"] = _data_seed(rng)
    return cfg


def merge(rng):
    """``numba_flash.merge_states``: parts with -inf (empty) lse, all-empty rows, sinks."""
    dtype = str(rng.choice(DTYPES))
    rows = tuple(int(x) for x in rng.integers(1, 4, size=int(rng.integers(1, 4))))
    cfg = dict(dtype=dtype, P=int(rng.integers(1, 6)), rows=rows, d=_head_dim(rng, 1, 40),
               empty=round(float(rng.choice([0.0, 0.2, 0.5])), 1),
               sink=str(rng.choice(["", "", "row", "last"])),
               spread=float(rng.choice([1.0, 5.0, 30.0])))
    cfg["seed"] = _data_seed(rng)
    return cfg


def flex(rng):
    """A user's ``score_mod`` / ``mask_mod`` (and a block mask) in the forward and backward of
    both kernel families."""
    cfg = forward(rng)
    while True:
        cfg["score_mod"] = str(rng.choice(SCORE_MODS))
        cfg["mask_mod"] = str(rng.choice(MASK_MODS))
        if cfg["score_mod"] or cfg["mask_mod"]:
            break
    cfg["block_mask"] = (int(rng.choice([16, 32])) if cfg["mask_mod"] and _chance(rng, 0.6)
                         else 0)
    cfg["p"] = 0.0 if cfg["block_mask"] else cfg["p"]
    cfg["det"] = _chance(rng, 0.5)
    cfg["dv"] = cfg["d"]
    return cfg


def torch_dense(rng):
    """``numba_flash.torch.flash_attn_func`` forward and backward through autograd (a sink that
    requires grad, dropout from torch's generator)."""
    cfg = forward(rng)
    cfg.pop("kernel")
    cfg["dv"] = cfg["d"]
    cfg["det"] = _chance(rng, 0.5)
    return cfg


def kvcache(rng):
    """``numba_flash.torch.flash_attn_with_kvcache``: flash-attn's layouts, appends into copies
    of the caches."""
    cfg = decode(rng)
    cfg["dtype"] = str(rng.choice(DTYPES))
    cfg["q3d"] = False
    cfg["alone"] = cfg["both"] = False
    cfg["score_mod"] = cfg["mask_mod"] = ""
    return cfg


GENERATORS = {"forward": forward, "backward": backward, "varlen": varlen, "decode": decode,
              "merge": merge, "flex": flex, "torch": torch_dense, "kvcache": kvcache}


def draw(op, index, seed=None):
    """Configuration ``index`` of ``op`` (``seed``: :func:`base_seed` by default)."""
    seed = base_seed() if seed is None else seed
    rng = np.random.default_rng([seed, OP_NUMBER[op], index])
    return GENERATORS[op](rng)


# ----------------------------------------------------------------------------------------------
# ids
# ----------------------------------------------------------------------------------------------
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def _value(v):
    if isinstance(v, (tuple, list)):
        return ",".join(_value(x) for x in v)
    if isinstance(v, float) and v == int(v):
        return str(int(v))
    return str(v)


def describe(op, index, cfg):
    """The pytest id: ``op`` and ``index``, then every key of ``cfg`` whose value is not its
    "off" value (False, 0, "", None, an unbounded window, ``dv == d``), ``key=value`` joined by
    ``_``, the data seed last."""
    parts = [f"{op}{index}", _SHORT.get(cfg.get("dtype"), cfg.get("dtype", ""))]
    items = [(k, v) for k, v in cfg.items() if k != "seed"] + [("seed", cfg["seed"])]
    for key, value in items:
        off = (value is None or value is False or value == ""
               or (key == "dv" and value == cfg["d"])
               or (key == "window" and tuple(value) == (-1, -1))
               or (key in ("softcap", "p", "new", "paged", "block_mask", "empty", "batch_idx")
                   and value == 0)
               or (key == "qmag" and value == 1.0))
        if key == "dtype" or off:
            continue
        parts.append(key if value is True else f"{key}={_value(value)}")
    return "_".join(p for p in parts if p)
