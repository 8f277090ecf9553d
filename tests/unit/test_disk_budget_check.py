"""A disk budget larger than the disk's free space: warned about at start-up (the key, where it
came from, the directory, the free space), never refused, since space may be freed."""

from __future__ import annotations

import logging
import os

from connector.config.loading import GB, load_config

KEY = "lmcache.max_local_disk_size"


def _fake_statvfs(free_bytes: int, seen: list[str]):  # type: ignore[no-untyped-def]
    def statvfs(path: str) -> os.statvfs_result:
        seen.append(path)
        block = 4096
        return os.statvfs_result((block, block, 10**9, 10**9, free_bytes // block) + (0,) * 5)

    return statvfs


def _config(directory, size_gb: float):  # type: ignore[no-untyped-def]
    return load_config({"lmcache.local_disk": str(directory), KEY: size_gb}, env={})


def test_a_budget_over_the_free_space_is_named_with_the_directory_and_the_free_space(tmp_path):
    from connector.config.disk_space import disk_budget_warning

    seen: list[str] = []
    config = _config(tmp_path, 50)
    said = disk_budget_warning(config, "env LMCACHE_MAX_LOCAL_DISK_SIZE", _fake_statvfs(20 * GB, seen))
    assert said is not None and seen == [str(tmp_path)]
    assert said.startswith(
        "KVLens config key 'max_local_disk_size' = 50 GB (from env LMCACHE_MAX_LOCAL_DISK_SIZE) is more "
        f"than the 20.0 GB free on the file system of local_disk '{tmp_path}': starting anyway"
    )
    assert disk_budget_warning(_config(tmp_path, 20), "x", _fake_statvfs(20 * GB, [])) is None


def test_a_directory_not_made_yet_is_measured_at_its_nearest_existing_parent(tmp_path):
    from connector.config.disk_space import disk_budget_warning

    seen: list[str] = []
    config = _config(tmp_path / "kv" / "deeper", 50)
    assert disk_budget_warning(config, "x", _fake_statvfs(1 * GB, seen)) is not None
    assert seen == [str(tmp_path)] and not (tmp_path / "kv").exists()


def test_a_file_system_that_cannot_be_asked_is_left_to_the_disk_tier_to_report(tmp_path):
    from connector.config.disk_space import disk_budget_warning

    def refuses(path: str) -> os.statvfs_result:
        raise PermissionError(13, "Permission denied")

    assert disk_budget_warning(_config(tmp_path, 50), "x", refuses) is None


def test_starting_with_a_budget_no_disk_holds_warns_once_and_starts(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = _config(tmp_path, 10**8)  # 100 PB: more than any test machine has free
    (record,) = [r for r in caplog.records if "max_local_disk_size" in r.getMessage()]
    said = record.getMessage()
    assert f"(from kv_connector_extra_config '{KEY}')" in said and repr(str(tmp_path)) in said
    assert " GB free on the file system of local_disk " in said
    assert config.disk_budget_bytes == 10**8 * GB  # accepted as given
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        _config(tmp_path, 0.001)
    assert caplog.records == []
