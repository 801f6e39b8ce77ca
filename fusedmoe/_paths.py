"""Where fusedmoe keeps what it writes for a user: measured ceilings, tuned kernel tables.

$FUSEDMOE_CACHE_DIR, else ~/.cache/fusedmoe. Plain path arithmetic: nothing is created here.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "FUSEDMOE_CACHE_DIR"


def cache_dir() -> Path:
    """$FUSEDMOE_CACHE_DIR, else ~/.cache/fusedmoe."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "fusedmoe"


def user_tuned_dir() -> Path:
    """The tuned tables `fusedmoe tune` writes by default: <cache dir>/tuned."""
    return cache_dir() / "tuned"
