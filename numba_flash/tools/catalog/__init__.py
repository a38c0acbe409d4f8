"""The compile tier's catalog: every launchable kernel configuration (kernel, argument types,
name), listed per kernel family in ``<area>.py`` beside this file, importing the kernels one
way (the kernels never import the catalog).  :data:`SOURCES` is the compile tier's row order.
"""

from __future__ import annotations

from .. import philox_check
from . import backward, cache, decode, forward, ptx, teach

#: every configuration list, in the compile tier's row order (the resource table's)
SOURCES = (
    backward.aux_grad_configs,
    backward.simt_configs,
    backward.mma_configs,
    backward.sparse_configs,
    decode.split_kv_configs,
    ptx.elements_configs,
    ptx.fp8_configs,
    forward.simt_configs,
    forward.mma_configs,
    forward.wgmma_configs,
    forward.fp8_configs,
    forward.wgmma_fp8_configs,
    cache.append_configs,
    decode.merge_configs,
    decode.mla_configs,
    ptx.mma_configs,
    teach.naive_forward_configs,
    philox_check.compile_configs,
    cache.rotary_configs,
    teach.row_forward_configs,
    teach.softmax_configs,
    ptx.stages_configs,
    teach.tiled_forward_configs,
    ptx.warp_gemm_configs,
    ptx.wgmma_configs,
)

#: the lists only teaching pages and tests launch (``elements``: the element stage's round-trip
#: test kernel): not warmed up by default
TEACHING = (teach.naive_forward_configs, philox_check.compile_configs, ptx.elements_configs)


def configs(sources=SOURCES):
    """Every configuration of ``sources``, in order."""
    for source in sources:
        yield from source()
