"""Exercise (docs/row-forward.md): predict what breaks, then let the check run it.

The check runs the first tiled kernel (``numba_flash/teach/kernels/row_forward.py``: ``BLOCK_M = 4``
threads, tiles of ``BLOCK_N = 6`` keys, plain attention, ``d = 4``) in the simulator, broken in
one way at a time, and compares every output row with the reference.  Before you run it, write
down what you expect, and why.

1. ``"no_load_barrier"``: the barrier after the tile copy is deleted; ``Nq = 8``, ``Nk = 18``
   (three tiles).  ``"right"`` or ``"wrong"``?
2. ``"no_end_barrier_one_tile"``: the barrier at the end of the tile step is deleted; ``Nq = 8``,
   ``Nk = 6`` (one tile).  ``"right"`` or ``"wrong"``?
3. ``"no_end_barrier"``: the same, with ``Nk = 18`` (three tiles).  ``"right"`` or ``"wrong"``?
4. ``"early_return_rows"``: both barriers are back, but a spare thread (``row >= Nq``) returns
   at once; ``Nq = 10``, ``Nk = 18``.  Which query rows come out wrong?  A sorted list of row
   numbers (``[]`` for none).

Check: ``python -m pytest -n 0 docs/exercises/test_predict_failures.py --exercises``.
"""

PREDICTION = {
    "no_load_barrier": None,          # "right" or "wrong"
    "no_end_barrier_one_tile": None,  # "right" or "wrong"
    "no_end_barrier": None,           # "right" or "wrong"
    "early_return_rows": None,        # a sorted list of query rows
}
