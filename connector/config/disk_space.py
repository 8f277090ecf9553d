"""Whether the disk tier's budget fits its disk: checked at start-up, where the settings meet the
file system.

A ``max_local_disk_size`` beyond the free space of the file system that holds ``local_disk`` is
a warning, never an error: space may be freed while the engine runs, and chunks KVLens already
keeps in the directory count toward the budget while they are no longer free. Left unsaid, the
disk fills before the tier does and stores fail (counted) without anyone having been told why.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .model import GB, KVLensConfig


def disk_budget_warning(
    config: KVLensConfig, source: str = "config", statvfs: Callable[[str], os.statvfs_result] | None = None
) -> str | None:
    """The warning when the disk budget exceeds the free space (None: it fits, or no disk tier)."""
    if not config.local_disk:
        return None
    where = _nearest_existing(os.path.abspath(config.local_disk))  # the tier creates the rest
    try:
        st = (statvfs or os.statvfs)(where)
    except OSError:  # the disk tier's own start says why it cannot use the directory
        return None
    free = st.f_bavail * st.f_frsize
    if config.disk_budget_bytes <= free:
        return None
    return (
        f"KVLens config key 'max_local_disk_size' = {config.max_local_disk_size:g} GB (from {source}) is "
        f"more than the {free / GB:.1f} GB free on the file system of local_disk {config.local_disk!r}: "
        "starting anyway (space may be freed, and chunks already there count toward the budget), but "
        "once the disk is full the tier's stores fail until space is freed or the size is lowered"
    )


def _nearest_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path
