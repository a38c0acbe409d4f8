"""The kernels, by kind (each subpackage's files are one kind):

* ``core/``: what every kernel is written with: the ``kernel_jit`` decorator and its disk cache
  (``jit``), element types (``elements``), shared types and head-dim rules (``common``), the
  variant-argument convention (``variant``) and the tile configurations (``tiles``);
* ``ptx/``: inline-PTX primitives, each with its simulator twin and probe kernels: ``mma.sync``
  (``mma``), ``wgmma``, and copies / ``ldmatrix`` / ``cp.async`` / ``ex2`` (``stages``);
* ``mainloop/``: the stages of one K/V tile step: the masking rule (``visibility``), scores
  (``tile_scores``), the online softmax, the tile walk, the warp GEMM;
* ``forward/``, ``backward/``, ``decode/``, ``cache/``: the kernel families (``simt``, ``mma``,
  ``wgmma``; the backward's ``aux_grad``; decode's ``split_kv``, ``mla`` and ``merge``; the KV
  cache's ``append`` and ``rotary``).

The teaching kernels live in :mod:`numba_flash.teach`, the compile tier's list of the modules
with launchable configurations in :mod:`numba_flash.tools.catalog`.
"""
