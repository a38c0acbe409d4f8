"""Solution of docs/exercises/predict_failures.py (docs/row-forward.md).

1. Without the barrier after the copy a thread reads ``K_j`` rows that other threads have not
   written yet: it scores its row against stale or empty keys.  Wrong.
2. The barrier at the end of a step only protects the *next* copy, which would overwrite ``K_j``
   and ``V_j`` while slower threads still read them.  With one tile there is no next copy:
   right.  (Right here is not proof of a correct kernel: it is a case the bug cannot reach.)
3. With three tiles a fast thread copies tile 1 over tile 0 while its neighbours still use tile
   0: wrong.
4. The spare threads of the last block (rows 10 and 11) copy no element of any tile: element
   ``e`` of a tile is copied by thread ``e % BLOCK_M``, so a quarter of the tile per missing
   thread stays stale.  Rows 8 and 9 share that block and read those elements: wrong.  Rows
   0-7 are in blocks with no spare thread: right.  (In the simulator the stale elements hold
   the previous block's last tile; on a GPU they hold whatever the shared memory held.)
"""

PREDICTION = {
    "no_load_barrier": "wrong",
    "no_end_barrier_one_tile": "right",
    "no_end_barrier": "wrong",
    "early_return_rows": [8, 9],
}
