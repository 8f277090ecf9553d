"""Fixtures of the benchmark smoke tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def server_pool(tmp_path_factory):
    """A pool file for the module's scripts (``--server-pool``); its servers stop with the module."""
    from bench.lib.server_pool import ServerPool

    pool = ServerPool(tmp_path_factory.mktemp("server-pool") / "pool.json")
    try:
        yield pool
    finally:
        pool.stop_all()
