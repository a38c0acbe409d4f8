"""The host side shared by every kernel: argument checks, array conversion, launch."""

from .arrays import ArrayCall, poisoned_outputs
from . import validate

__all__ = ["ArrayCall", "poisoned_outputs", "validate"]
