"""The install lines that error messages name, in one place (and the README's words).

numba_flash is not on PyPI: it and its extras install from a clone of the repository,
``pip install '.[extra]'``.  The test extra is installed editable, as the README's quick start
does (the suite runs from the clone).  torch goes first, from its CPU index on a machine without
a GPU: on Linux PyPI's torch is the CUDA build, about 15 nvidia wheels.  This module imports
nothing, so that ``--help`` and a failed import stay fast.
"""

from __future__ import annotations

#: torch's CPU build, the version the suite is tested with (README, "PyTorch")
TORCH_CPU = "pip install 'torch==2.13.*' --index-url https://download.pytorch.org/whl/cpu"


def pip_extra(extra):
    """The install line of an extra of ``setup.cfg``, from the clone (not on PyPI); the test
    extra editable, as the README installs it."""
    editable = "-e " if extra == "test" else ""
    return f"pip install {editable}'.[{extra}]' (in the numba_flash clone)"


def torch_first(extra="torch"):
    """Install torch first (its CPU build without a GPU), then the extra that needs it."""
    return (f"install torch first ({TORCH_CPU} on a machine without a GPU; with one, the line "
            f"for its CUDA version from pytorch.org), then {pip_extra(extra)}")
