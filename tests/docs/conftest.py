"""The docs tier: the snippet tool, the notes' code as transcribed, the I/O counter, the stepping
script and the pictures.  ``docs/examples`` and ``docs`` are put on ``sys.path`` so the tests can
import the scripts the pages quote."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for sub in ("docs/examples", "docs"):
    p = str(ROOT / sub)
    if p not in sys.path:
        sys.path.insert(0, p)
