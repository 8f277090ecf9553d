"""Configurations written the way LMCache's examples, CI and documentation write them start, start
with one warning, or are refused for the reason the rule gives.

Each case in data/lmcache_configs/ is KVLens's own copy of one LMCache configuration (same keys
and values; the source is named on its first line): ``<case>.yaml`` is the file
``LMCACHE_CONFIG_FILE`` names, ``<case>.env`` the process's environment (``NAME=value`` as the
process sees it), ``<case>.json`` vLLM's ``kv_connector_extra_config``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from connector.config.loading import ConfigError, load_config

DATA = Path(__file__).parent / "data" / "lmcache_configs"


@dataclass(frozen=True)
class Expect:
    outcome: str  # "starts" (no warning), "warns" (starts with one warning) or "refused"
    words: tuple[str, ...] = ()  # unused settings named in the warning, or the refusal's reasons
    tiers: tuple[str, ...] = ()  # for a configuration that starts


def starts(*tiers: str) -> Expect:
    return Expect("starts", tiers=tiers or ("cpu",))


def warns(*words: str, tiers: tuple[str, ...] = ("cpu",)) -> Expect:
    return Expect("warns", words, tiers)


def refused(*words: str) -> Expect:
    return Expect("refused", words)


PD = "nixl transfer channel is not supported by KVLens; instead: transfer_channel: tcp"
P2P = "enable_p2p = 'True' (from env LMCACHE_ENABLE_P2P) turns on P2P sharing"
CONTROLLER = "turns on the LMCache controller"
LM = "remote_url lm://... (from LMCACHE_CONFIG_FILE"

EXPECTED: dict[str, Expect] = {
    # .buildkite/configs
    "ci_async": warns(
        "extra_config.lookup_backoff_time",
        "extra_config.use_odirect",
        tiers=("disk",),
    ),
    "ci_dummy": starts(),
    "ci_layerwise": starts(),
    "ci_lmcache_config": warns(
        "internal_api_server_enabled",
        "plugin_locations",
        "extra_config.save_only_first_rank",
        "extra_config.plugin.frontend.port",
    ),
    "ci_local_cpu": starts(),
    "ci_local_cpu_mla": starts(),
    "ci_local_cpu_with_v3": warns("use_gpu_connector_v3"),
    "ci_local_disk": starts("disk"),
    "ci_local_disk_with_v3": warns("use_gpu_connector_v3", tiers=("disk",)),
    "ci_multi_device": refused(
        "gds_path = '/tmp/' (from env LMCACHE_GDS_PATH) turns on the GPU Direct Storage"
    ),
    "ci_p2p": refused(P2P, CONTROLLER),
    "ci_p2p_with_v3": refused(P2P, CONTROLLER),
    "ci_pd_prefiller": refused("enable_pd = 'True' (from env LMCACHE_ENABLE_PD)", PD),
    "ci_pd_decoder": refused(
        "enable_pd = 'True' (from env LMCACHE_ENABLE_PD)", PD, "pd_role receiver needs pd_peer_init_port"
    ),
    # examples/
    "ex_blend_kv_v1": starts(),
    "ex_cache_by_tags": warns("local_device"),
    "ex_cache_controller": refused("enable_controller = True", CONTROLLER),
    "ex_caching_switch": warns("local_device"),
    "ex_disagg_1p1d_decoder": refused("enable_nixl = True", "NIXL transfer channel", "transfer_channel: tcp"),
    "ex_disagg_1p1d_prefiller": refused("enable_pd = True", PD),
    "ex_disagg_1p1d_decoder_with_remote": refused(LM, "remote_serde = 'cachegen'", "enable_pd = True"),
    "ex_disk_offline_inference": warns("local_device", "pipelined_backend"),
    "ex_disk_offline_inference_disk_url": warns("local_device", "disk_path", "pipelined_backend"),
    "ex_example": refused(LM, "points at the LMCache server"),
    "ex_docker": refused(LM, "remote_serde = 'cachegen'"),
    "ex_offline_inference": refused(LM, "remote_serde = 'cachegen'"),
    "ex_save_decode_cache": warns("local_device"),
    "ex_storage_cpu_redis": refused("remote_serde = 'cachegen'", "CacheGen compression"),
    "ex_storage_disk_local": warns("local_device"),
    "ex_storage_cpu_local": warns("local_device", "pipelined_backend"),
    "ex_centralized_sharing": refused(LM, "remote_serde = 'cachegen'"),
    "ex_p2p_sharing": refused("enable_p2p = True", CONTROLLER),
    "ex_s3": refused("remote_url s3://... (from LMCACHE_CONFIG_FILE", "points at S3"),
    "ex_tigris": refused("remote_url s3://...", "points at S3"),
    "ex_resp": refused("unknown key 'async_loading'", "did you mean 'enable_async_loading'?"),
    "ex_external_backend": refused("remote_url external://...", "external LMCache connector"),
    "ex_mooncakestore": refused("remote_url mooncakestore://...", "Mooncake Store"),
    "ex_benchmark_backend": refused("remote_url benchmark://...", "benchmark backend"),
    "ex_sgl_integration": starts(),
    "ex_sample_integration": warns("local_device", "remote_serde = 'cachegen'", "pipelined_backend"),
    "ex_experimental": starts(),
    "ex_lmc_connector": starts(),
    # docs/source
    "doc_cpu_ram": starts(),
    "doc_cpu_ram_env": starts(),
    "doc_cpu_ram_hugepages": warns("local_cpu_use_hugepages"),
    "doc_local_storage": warns("extra_config.use_odirect", tiers=("cpu", "disk")),
    "doc_local_storage_env": warns("extra_config.use_odirect", tiers=("cpu", "disk")),
    "doc_disk_offload": starts("disk"),
    "doc_redis": starts("cpu", "remote"),
    "doc_redis_env": starts("cpu", "remote"),
    "doc_redis_sentinel": starts("cpu", "remote"),
    "doc_redis_sentinel_env": starts("cpu", "remote"),
    "doc_redis_offload": starts("cpu", "remote"),
    "doc_redis_remote_only": starts("remote"),
    "doc_lmcache_server": refused(LM, "LMCache server"),
    "doc_valkey_standalone": starts("cpu", "remote"),
    "doc_valkey_database": starts("cpu", "remote"),
    "doc_valkey_cluster_endpoint": starts("cpu", "remote"),
    "doc_valkey_cluster_nodes": starts("cpu", "remote"),
    "doc_resp": starts("cpu", "remote"),
    "doc_gds": refused("gds_path = '/mnt/gds/cache' (from LMCACHE_CONFIG_FILE", "GPU Direct Storage"),
    "doc_gds_env": refused("gds_path = '/mnt/gds/cache' (from env LMCACHE_GDS_PATH)", "GPU Direct Storage"),
    "doc_infinistore": refused("remote_url infinistore://...", "InfiniStore"),
    "doc_mooncake": refused("remote_url mooncakestore://...", "Mooncake Store"),
    "doc_caching_policies": starts(),
    "doc_caching_policies_lfu": starts(),
    "doc_p2p_socket_timeouts": warns(
        "extra_config.p2p_socket_recv_timeout_ms", "extra_config.p2p_socket_send_timeout_ms"
    ),
    "doc_nixl_storage": refused("extra_config.enable_nixl_storage = True", "NIXL as a storage backend"),
    "doc_histogram_buckets": warns("extra_config.histogram_bucket_time_to_retrieve"),
    "doc_lazy_allocator": warns(
        "enable_lazy_memory_allocator", "lazy_memory_initial_ratio", "reserve_local_cpu_size"
    ),
    "doc_usage_tracking": starts(),
}


def sources(case: str) -> tuple[dict, dict]:
    env: dict[str, str] = {}
    extra: dict = {}
    for path in sorted(DATA.glob(case + ".*")):
        if path.suffix == ".yaml":
            env["LMCACHE_CONFIG_FILE"] = str(path)
        elif path.suffix == ".env":
            for line in path.read_text().splitlines():
                if line and not line.startswith("#"):
                    name, _, value = line.partition("=")
                    env[name] = value
        elif path.suffix == ".json":
            extra = json.loads(path.read_text())
    return extra, env


def test_every_case_on_disk_has_an_expectation_and_every_expectation_a_case():
    on_disk = {p.name.split(".")[0] for p in DATA.iterdir()}
    assert on_disk == set(EXPECTED)


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_lmcache_configuration_starts_or_is_refused_as_the_rule_says(case, caplog, disk_with_room):
    expect = EXPECTED[case]
    extra, env = sources(case)
    if expect.outcome == "refused":
        with pytest.raises(ConfigError) as e:
            load_config(extra, env=env)
        message = str(e.value)
        for words in expect.words:
            assert words in message, message
        assert "not supported by KVLens" in message or "unknown key" in message
        assert "Input should" not in message and "Extra inputs" not in message
        return
    with caplog.at_level(logging.WARNING, logger="vllm.kvlens"):
        config = load_config(extra, env=env)
    assert config.tier_names() == expect.tiers
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    if expect.outcome == "starts":
        assert not warnings and not config.unused_settings
    else:
        assert len(warnings) == 1  # one warning, naming every setting KVLens does not use
        for words in expect.words:
            assert words in warnings[0].getMessage()


def test_the_tally(capsys):
    """How many of LMCache's configurations start, start with a warning, or are refused."""
    tally = Counter(e.outcome for e in EXPECTED.values())
    with capsys.disabled():
        print(f"\nLMCache configurations: {dict(tally)} of {len(EXPECTED)}")
    assert sum(tally.values()) == len(EXPECTED) >= 60
