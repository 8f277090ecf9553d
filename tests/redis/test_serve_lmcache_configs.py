"""Real vLLM engines (CPU, tiny model) started the way LMCache's documentation starts them:
LMCACHE_CONFIG_FILE names an LMCache YAML file. One behind real Redis Sentinels starts and serves
its prompts from the master they name; one that turns on CacheBlend does not start, and says why."""

from __future__ import annotations

import pytest

from ..integration import workloads as w
from ..integration.conftest import lmcache_tokens, outputs, run_engine

pytestmark = pytest.mark.integration

# Written as LMCache's Redis page writes a Sentinel configuration (no service name in the URL:
# LMCache takes it from REDIS_SERVICE_NAME), plus older keys its examples carry.
SENTINEL_YAML = """\
chunk_size: 256
local_cpu: False
remote_url: "redis-sentinel://{hosts}"
remote_serde: "naive"
pipelined_backend: False
extra_config:
  lookup_backoff_time: 0.001
"""


def test_an_lmcache_sentinel_config_file_starts_and_serves_from_the_master(
    private_sentinels, tiny_model, tmp_path
):
    hosts = ",".join(f"127.0.0.1:{p}" for p in private_sentinels.sentinel_ports)
    path = tmp_path / "redis-sentinel-offload.yaml"
    path.write_text(SENTINEL_YAML.format(hosts=hosts))
    env = {"LMCACHE_CONFIG_FILE": str(path), "REDIS_SERVICE_NAME": private_sentinels.service}
    rounds = [{"prompts": [w.A]}, {"prompts": [w.A]}]  # vLLM's own prefix cache is reset between
    result = run_engine({"model": tiny_model, "kv": {}, "rounds": rounds}, tmp_path, env=env)
    cold, warm = result["rounds"]
    assert lmcache_tokens(cold) == [0] and lmcache_tokens(warm)[0] >= 512  # from Redis: no CPU tier
    assert outputs(warm) == outputs(cold)
    assert "KVLens accepts and does not use these LMCache settings" in result["log"]
    assert "pipelined_backend" in result["log"] and "extra_config.lookup_backoff_time" in result["log"]
    with private_sentinels.current_master().client() as master:
        assert master.dbsize() > 0  # the chunks are on the master the sentinels name
