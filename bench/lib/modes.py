"""The modes a benchmark puts side by side, and what each configures in vLLM.

A mode is a vLLM server configured one way: no connector (vLLM's prefix caching only), the
same with enough KV memory for the whole working set (the ceiling) or with prefix caching off
(``full``: every prompt computed in full, the reference of answer quality), KVLens with one storage
tier, vLLM's ``ExampleConnector``, or LMCache in its multiprocess mode (from its server's
memory, or from a disk L2 behind it). Every mode gets the same model, worker cores and
KV-memory settings; only ``--kv-transfer-config`` (and, for the ceiling, the KV block limit;
for LMCache, its server's arguments; for ``full``, prefix caching) differs. KVLens is treated as
a black box configured only through ``--kv-transfer-config``, as users configure it.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .paths import REPO, peers_tmp

LMCACHE_SETUP = REPO / "bench" / "peers" / "lmcache_mp_setup.sh"
LMCACHE_SETUP_TIMEOUT_S = 1200.0
LMCACHE_MQ_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Mode:
    name: str  # as given to --modes and used in the JSON
    label: str  # for the table and the plot
    connector: str | None  # None, "kvlens", "example", "lmcache"
    tier: str | None = None  # KVLens's tier; for LMCache, its server's L2 (None: memory only)
    ceiling: bool = False  # vLLM's KV memory is not limited by the workload
    optional: bool = False  # a peer: when it cannot run, the run goes on without it
    prefix_caching: bool = True  # False: --no-enable-prefix-caching (every prompt computed in full)


@dataclass(frozen=True, slots=True)
class Settings:
    """What the modes are configured with (from the command line)."""

    storage_dir: Path  # disk tier and ExampleConnector files (removed at the end of a run)
    kvlens_chunk_size: int = 256
    kvlens_cpu_gb: float = 4.0
    kvlens_disk_gb: float = 8.0
    kvlens_remote_url: str | None = None
    lmcache_chunk_size: int = 128
    lmcache_l1_gb: float = 2.0
    lmcache_venv: Path = peers_tmp() / "venv-lmcache"
    kvlens_extra_config: dict[str, Any] = field(default_factory=dict)  # lmcache.extra_config


def _kvlens_cpu(s: Settings) -> dict[str, Any]:
    return {"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": s.kvlens_cpu_gb}


def _kvlens_disk(s: Settings) -> dict[str, Any]:
    return {
        "lmcache.local_cpu": False,
        "lmcache.local_disk": str(s.storage_dir / "kvlens-disk"),
        "lmcache.max_local_disk_size": s.kvlens_disk_gb,
    }


def _kvlens_remote(s: Settings) -> dict[str, Any]:
    if not s.kvlens_remote_url:
        raise ValueError("the KVLens remote tier needs --kvlens-remote-url (e.g. redis://127.0.0.1:6379)")
    return {"lmcache.local_cpu": False, "lmcache.remote_url": s.kvlens_remote_url}


def _kvlens_cpu_in_step(s: Settings) -> dict[str, Any]:
    """The CPU tier with layer-wise copies off: every copy runs inside the step (the A/B of
    copying beside the forward pass)."""
    return {**_kvlens_cpu(s), "lmcache.use_layerwise": False}


def _kvlens_cpu_disk(s: Settings) -> dict[str, Any]:
    """A CPU tier over a disk tier, over a remote tier when --kvlens-remote-url is given."""
    remote = {"lmcache.remote_url": s.kvlens_remote_url} if s.kvlens_remote_url else {}
    return {**_kvlens_cpu(s), **_kvlens_disk(s), "lmcache.local_cpu": True, **remote}


def _asynchronously(tier: Callable[[Settings], dict[str, Any]]) -> Callable[[Settings], dict[str, Any]]:
    """The tier with asynchronous loads (the request waits outside the batch while it loads)."""
    return lambda s: {**tier(s), "lmcache.enable_async_loading": True}


BLEND_MIN_TOKENS = 64  # the RAG set's documents are ~150 tokens; LMCache's default (256) skips them


def _blending(ratio: float | None) -> Callable[[Settings], dict[str, Any]]:
    """The CPU tier with blending on (``enable_blending``), at LMCache's default recompute ratio
    (None) or at ``ratio`` (0: naive concatenation of the stored documents' moved KV)."""
    ratios = {} if ratio is None else {"lmcache.blend_recompute_ratios": ratio}
    return lambda s: {
        **_kvlens_cpu(s),
        "lmcache.enable_blending": True,
        "lmcache.blend_min_tokens": BLEND_MIN_TOKENS,
        **ratios,
    }


# KVLens tiers by name: the hook for new tiers (--kvlens-tiers cpu,disk,remote).
KVLENS_TIERS: dict[str, Callable[[Settings], dict[str, Any]]] = {
    "cpu": _kvlens_cpu,
    "cpu-in-step": _kvlens_cpu_in_step,
    "disk": _kvlens_disk,
    "disk-async": _asynchronously(_kvlens_disk),
    "cpu-disk": _kvlens_cpu_disk,
    "remote": _kvlens_remote,
    "remote-async": _asynchronously(_kvlens_remote),
    "cpu-blend": _blending(None),
    "cpu-blend0": _blending(0.0),
}

FIXED_MODES = {
    "none": Mode("none", "no connector", None),
    "ceiling": Mode("ceiling", "ceiling (no connector, KV memory for all)", None, ceiling=True),
    "full": Mode("full", "full prefill (no connector, prefix caching off)", None, prefix_caching=False),
    "example": Mode("example", "vLLM ExampleConnector (disk)", "example"),
    "lmcache": Mode("lmcache", "LMCache 0.5.6 MP mode", "lmcache", optional=True),
    "lmcache-disk": Mode(
        "lmcache-disk", "LMCache 0.5.6 MP mode, disk L2", "lmcache", tier="disk", optional=True
    ),
}
# Names a user may try for LMCache modes that cannot run here, and why.
LMCACHE_NOT_HERE = {
    "lmcache-async": (
        "LMCache's MP mode (the 'lmcache' modes) always loads asynchronously: vLLM's "
        "LMCacheMPConnector.get_num_new_matched_tokens returns load_kv_async = need_to_load > 0; "
        "enable_async_loading belongs to its in-process LMCacheConnectorV1, which has no CPU path "
        "in 0.5.6 (CreateGPUConnector: 'No supported cpu connector found', then recompute)"
    ),
}


def lmcache_server_args(mode: Mode, s: Settings) -> list[str]:
    """The mode's arguments for LMCache's server beyond the common ones (``LMCacheServer``).

    ``disk``: a filesystem L2 under the storage directory with the ``skip_l1`` store policy, so a
    chunk leaves the server's memory once it is on disk and a later hit is prefetched from the
    disk at lookup (LMCache's disk path, as KVLens's ``disk`` tier has no memory tier above it)."""
    if mode.connector != "lmcache" or mode.tier is None:
        return []
    if mode.tier == "disk":
        l2 = {"type": "fs", "base_path": str(lmcache_disk_dir(s))}
        return ["--l2-adapter", json.dumps(l2), "--l2-store-policy", "skip_l1"]
    raise ValueError(f"mode {mode.name}: unknown LMCache L2 {mode.tier!r}")


def lmcache_disk_dir(s: Settings) -> Path:
    return s.storage_dir / "lmcache-disk"


def kvlens_mode(tier: str) -> Mode:
    if tier not in KVLENS_TIERS:
        raise ValueError(f"unknown KVLens tier {tier!r}; known: {', '.join(KVLENS_TIERS)}")
    return Mode(f"kvlens-{tier}", f"KVLens {tier} tier", "kvlens", tier=tier)


def parse_modes(spec: str, tiers: str) -> list[Mode]:
    """``none,kvlens,example,lmcache`` with ``kvlens`` standing for one mode per tier in ``tiers``."""
    modes: list[Mode] = []
    for name in (n.strip() for n in spec.split(",") if n.strip()):
        if name == "kvlens":
            modes += [kvlens_mode(t.strip()) for t in tiers.split(",") if t.strip()]
        elif name.startswith("kvlens-"):
            modes.append(kvlens_mode(name.removeprefix("kvlens-")))
        elif name in FIXED_MODES:
            modes.append(FIXED_MODES[name])
        elif name in LMCACHE_NOT_HERE:
            raise ValueError(f"mode {name!r} cannot run here: {LMCACHE_NOT_HERE[name]}")
        else:
            raise ValueError(
                f"unknown mode {name!r}; known: {', '.join([*FIXED_MODES, 'kvlens', 'kvlens-<tier>'])}"
            )
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"a mode is named twice in {names}")
    return modes


def kvlens_disk_dir(s: Settings, mode_name: str) -> Path:
    """The disk tier directory of KVLens mode ``mode_name`` (one per mode)."""
    return s.storage_dir / f"{mode_name}-disk"


def kv_transfer_config(mode: Mode, s: Settings, lmcache_port: int | None = None) -> dict[str, Any] | None:
    """The mode's ``--kv-transfer-config`` (None: no connector)."""
    if mode.connector is None:
        return None
    if mode.connector == "kvlens":
        assert mode.tier is not None
        extra = {"lmcache.chunk_size": s.kvlens_chunk_size, **KVLENS_TIERS[mode.tier](s)}
        if "lmcache.local_disk" in extra:  # a directory per mode: servers side by side share nothing
            extra["lmcache.local_disk"] = str(kvlens_disk_dir(s, mode.name))
        if s.kvlens_extra_config:
            extra["lmcache.extra_config"] = dict(s.kvlens_extra_config)
        return {
            "kv_connector": "KVLensConnector",
            "kv_connector_module_path": "connector",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    if mode.connector == "example":
        path = s.storage_dir / "example-connector"
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(path)},
        }
    if mode.connector == "lmcache":
        assert lmcache_port is not None
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": lmcache_port,
                "lmcache.mp.mq_timeout": LMCACHE_MQ_TIMEOUT_S,
                "lmcache.mp.mp_transfer_mode": "engine_driven",
            },
        }
    raise ValueError(f"mode {mode.name}: unknown connector {mode.connector!r}")


def lmcache_venv_problem(venv: Path, build: bool) -> str | None:
    """None when LMCache's virtualenv can run the peer; else why not. With ``build``, the
    recipe's setup script creates or completes it first (idempotent; ~2 minutes from scratch)."""
    if build:
        print(f"setting up LMCache's virtualenv {venv} (bench/peers/lmcache_mp_setup.sh)", flush=True)
        try:
            done = subprocess.run(
                ["bash", str(LMCACHE_SETUP)],
                env={**os.environ, "PEERS_TMP": str(venv.parent)},
                capture_output=True,
                text=True,
                timeout=LMCACHE_SETUP_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"its setup script failed: {e}"
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return f"its setup script exited with {done.returncode}: {' | '.join(tail)}"
        if venv.name != "venv-lmcache":
            return f"the setup script builds {venv.parent}/venv-lmcache, not {venv}"
    for exe in ("python", "lmcache"):
        if not (venv / "bin" / exe).exists():
            hint = (
                ""
                if build
                else " (build it with --lmcache-setup yes or bash bench/peers/lmcache_mp_setup.sh)"
            )
            return f"no {venv / 'bin' / exe}{hint}"
    return None
