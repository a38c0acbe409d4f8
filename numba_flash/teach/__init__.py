"""Teaching kernels and their ops: the naive forward, the row-per-thread forward, the tiled
teaching forward and the row softmax.  Each is self-contained on purpose (docs/naive-forward.md,
docs/row-forward.md, docs/tiled-forward.md and docs/online-softmax.md read them whole).
"""
