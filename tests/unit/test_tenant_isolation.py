"""What one tenant (a cache salt or key tags) can learn of another, and how much state clients
can make a scheduler keep: responses never depend on another tenant's prompts, tenant ids are
keyed with a per-deployment secret, salts, tags and namespaces are bounded (issue 26, items
12, 15 and 16). Pure: stand-ins for vLLM."""

from __future__ import annotations

import time

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts
from connector.engine.keys import Namespace, first_chunk_fingerprint, key_fingerprint
from connector.engine.namespace_marks import MarkView, mark_of
from connector.engine.namespace_records import NamespaceRecord
from connector.engine.namespaces import FirstChunkNamespaces
from connector.engine.outcomes import MissReason
from connector.scheduler.connector_scheduler import ConnectorScheduler
from connector.scheduler.responses import for_client

from .fakes import BLOCK, BLOCK_BYTES, LAYERS, admit_fully, blocks, request
from .test_admin import PROMPT, Worker, _hashed

BASE = Namespace("m", "bfloat16", "L")


def _on_model(tmp_path, model: str, **extra) -> ConnectorScheduler:
    """A scheduler on a disk directory others share, serving ``model``."""
    settings = {"local_disk": str(tmp_path / "disk"), "max_local_disk_size": 1, **extra}
    config = load_config({f"lmcache.{k}": v for k, v in settings.items()}, env={})
    facts = EngineFacts(model, "bfloat16", BLOCK, LAYERS, BLOCK_BYTES, "L", 1, "kv_both")
    return ConnectorScheduler(config, facts)


def _wait(predicate, what):
    deadline = time.monotonic() + 15
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _client_reason(s: ConnectorScheduler, rid: str, **kw) -> dict:
    req = _hashed(rid, PROMPT, **kw)
    s.lookup(req, 0)
    return s.finish(req).params["kvlens"]


# ---- item 12: a response never depends on another tenant's prompts -------------------------
def _store_on_model(tmp_path, model: str, **kw) -> None:
    a = _on_model(tmp_path, model)
    req = _hashed("stored", PROMPT, **kw)
    _, plan = admit_fully(a, req, blocks(10, 5))
    Worker(a).run(plan)
    a.finish(req)
    a.shutdown()  # writes the marks still queued


def test_another_tenants_prompt_on_another_model_reads_not_stored_to_the_client(tmp_path):
    """The shared-marks path: another model, another salt. The answer is the one the client gets
    when nobody stored the prompt."""
    _store_on_model(tmp_path, "model-a", cache_salt="victim-salt")
    b = _on_model(tmp_path, "model-b")
    try:
        _wait(lambda: len(b.state.shared_marks.view) > 0, "marks read at start")
        usage = _client_reason(b, "probe", cache_salt="attacker-salt")
        assert usage["miss_reason"] == "not_stored" and "miss_detail" not in usage, usage
        tagged = _client_reason(b, "tagged", kv_transfer_params={"lmcache.tag.user": "mallory"})
        assert tagged["miss_reason"] == "not_stored" and "miss_detail" not in tagged, tagged
        plain = _client_reason(b, "plain")  # the default tenant is not the salted one either
        assert plain["miss_reason"] == "not_stored" and "miss_detail" not in plain, plain
    finally:
        b.shutdown()


def test_the_same_tenant_on_another_model_still_learns_what_differs(tmp_path):
    _store_on_model(tmp_path, "model-a", cache_salt="team-salt")
    b = _on_model(tmp_path, "model-b")
    try:
        _wait(lambda: len(b.state.shared_marks.view) > 0, "marks read at start")
        usage = _client_reason(b, "same", cache_salt="team-salt")
        assert usage["miss_reason"] == "other_namespace"
        assert usage["miss_detail"] == {"differs_in": ["model"]}
        other = _client_reason(b, "other", cache_salt="other-salt")
        assert other["miss_reason"] == "not_stored"
        log = {d.request_id: d for d in b.take_done()}  # the operator still sees it
        assert log["other"].miss_reason is MissReason.OTHER_NAMESPACE
        assert log["other"].miss_detail == {"differs_in": ["model", "cache_salt"]}
    finally:
        b.shutdown()


def test_the_miss_metric_does_not_tell_a_client_another_tenant_stored_its_prompt(tmp_path):
    """/metrics is served on the API port: its miss reason follows the response's."""
    _store_on_model(tmp_path, "model-a", cache_salt="victim-salt")
    b = _on_model(tmp_path, "model-b")
    try:
        _wait(lambda: len(b.state.shared_marks.view) > 0, "marks read at start")
        req = _hashed("probe", PROMPT, cache_salt="attacker-salt")
        b.lookup(req, 0)
        outcome = b.finish(req).unscheduled_lookup
        assert outcome is not None and outcome.miss_reason is MissReason.NOT_STORED
    finally:
        b.shutdown()


def _same_tenant_other_lora(ns: Namespace) -> Namespace:
    return Namespace(ns.model, ns.dtype, ns.kv_layout, ns.world_size, "adapter-1", ns.cache_salt, ns.tags)


def test_the_shared_view_answers_a_tenant_alike_whoever_stored_the_prompt_since():
    fp = first_chunk_fingerprint(PROMPT, 256)
    mine = BASE.with_request(None, "mine", {})
    own = _same_tenant_other_lora(mine)  # the client's own namespace under an adapter
    theirs = BASE.with_request(None, "theirs", {})
    records = {key_fingerprint(n): NamespaceRecord.of(n) for n in (own, theirs)}
    alone, crowded = MarkView(), MarkView()
    alone.replace([(mark_of(fp), key_fingerprint(own))], records)
    crowded.replace([(mark_of(fp), key_fingerprint(own)), (mark_of(fp), key_fingerprint(theirs))], records)
    assert alone.other(fp, mine) == crowded.other(fp, mine) == records[key_fingerprint(own)]


def test_the_local_memory_answers_a_tenant_alike_however_many_tenants_stored_the_prompt():
    fp = first_chunk_fingerprint(PROMPT, 256)
    mine = BASE.with_request(None, "mine", {})
    own = _same_tenant_other_lora(mine)
    alone, crowded = FirstChunkNamespaces(), FirstChunkNamespaces()
    alone.note(fp, own)
    crowded.note(fp, own)
    for i in range(8):  # more tenants than a prompt's entries: the own one must not be pushed out
        crowded.note(fp, BASE.with_request(None, f"tenant-{i}", {}))
    assert alone.other(fp, mine) == crowded.other(fp, mine) == own


def test_for_client_hides_any_tenant_part():
    usage = {"miss_reason": "other_namespace", "miss_detail": {"differs_in": ["model", "cache_salt"]}}
    assert for_client(usage) == {"miss_reason": "not_stored"}


# ---- item 15: tenant ids are keyed with a per-deployment secret ----------------------------
def _public_constant_id(value: str) -> str:
    """The id every KVLens computed before: anyone could recompute it from a guessed salt."""
    import hashlib

    return hashlib.blake2b(value.encode(), digest_size=5, key=b"kvlens-tenant").hexdigest()


def _config(**settings):
    if "local_disk" in settings:
        settings["max_local_disk_size"] = 1
    return load_config({f"lmcache.{k}": v for k, v in settings.items()}, env={})


def test_a_tenant_id_cannot_be_recomputed_from_the_salt_without_the_deployments_key(tmp_path):
    from connector.engine.tenants import TenantIds
    from connector.scheduler.tenant_id_key import deployment_key

    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = TenantIds(deployment_key(_config(local_disk=str(tmp_path / "one"))))
    two = TenantIds(deployment_key(_config(local_disk=str(tmp_path / "two"))))
    salted = BASE.with_request(None, "tenant-42", {})
    tenant = one.tenant_id(salted)
    assert tenant.startswith("salt:") and len(tenant) == len("salt:") + 16  # 64 bits
    assert tenant != f"salt:{_public_constant_id('tenant-42')}"
    assert tenant != two.tenant_id(salted)  # another deployment: another id
    tagged = BASE.with_request(None, None, {"user": "alice"})
    assert one.tenant_id(tagged).startswith("user:") and "alice" not in one.tenant_id(tagged)
    assert one.tenant_id(BASE) == "default"


def test_instances_sharing_a_disk_directory_compute_the_same_ids(tmp_path):
    import stat

    from connector.engine import tenants
    from connector.scheduler.tenant_id_key import deployment_key

    (tmp_path / "disk").mkdir()
    config = _config(local_disk=str(tmp_path / "disk"))
    first, again = deployment_key(config), deployment_key(config)
    assert first == again and len(first) >= 16
    (path,) = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # readable by the engine's user only
    s = _on_model(tmp_path, "m")
    try:  # a scheduler on that directory counts its tenants under the deployment's ids
        salted = BASE.with_request(None, "tenant-42", {})
        assert tenants.tenant_id(salted) == tenants.TenantIds(first).tenant_id(salted)
    finally:
        s.shutdown()


def test_a_configured_key_gives_the_same_ids_wherever_the_cache_is(tmp_path):
    from connector.engine.tenants import TenantIds
    from connector.scheduler.tenant_id_key import deployment_key

    secret = "a-long-operator-secret-0123456789"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    a = deployment_key(_config(local_disk=str(tmp_path / "a"), extra_config={"tenant_id_key": secret}))
    b = deployment_key(_config(local_disk=str(tmp_path / "b"), extra_config={"tenant_id_key": secret}))
    (tmp_path / "key").write_text(secret + "\n")
    c = deployment_key(_config(extra_config={"tenant_id_key_file": str(tmp_path / "key")}))
    assert a == b == c
    assert not list((tmp_path / "a").rglob("*"))  # nothing generated, nothing written
    salted = BASE.with_request(None, "s", {})
    assert TenantIds(a).tenant_id(salted) != TenantIds(
        deployment_key(_config(local_disk=str(tmp_path / "b")))
    ).tenant_id(salted)


# ---- item 16: what clients size is bounded, and what is refused is counted ------------------
def test_an_over_long_salt_or_tag_is_served_without_kvlens_and_counted():
    from .fakes import scheduler

    s = scheduler()
    cases = {
        "salt": ({"cache_salt": "s" * 257}, "salt_too_long"),
        "tag": ({"kv_transfer_params": {"lmcache.tag.user": "u" * 257}}, "tag_too_long"),
        "name": ({"kv_transfer_params": {f"lmcache.tag.{'n' * 257}": "u"}}, "tag_too_long"),
        "many": ({"kv_transfer_params": {f"lmcache.tag.t{i}": "v" for i in range(9)}}, "too_many_tags"),
    }
    for rid, (kw, _) in cases.items():
        req = request(rid, PROMPT, **kw)
        need, plan = admit_fully(s, req, blocks(10, 5))
        assert need == 0 and not plan.writes  # nothing loaded, nothing stored
        usage = s.finish(req).params["kvlens"]
        assert usage["miss_reason"] == "invalid_params" and "tenant" not in usage
    refusals = s.take_tenant_usage().refusals
    assert refusals == {"salt_too_long": 1, "tag_too_long": 2, "too_many_tags": 1}
    ok = request("ok", PROMPT, cache_salt="s" * 256, kv_transfer_params={"lmcache.tag.user": "u" * 256})
    assert (
        s.lookup(ok, 0) == 0 and s.lookups["ok"].miss_reason is MissReason.NOT_STORED
    )  # at the bound: served


def test_the_bounds_on_salts_and_tags_are_settings():
    from .fakes import scheduler

    s = scheduler(extra_config={"cache_salt_max_chars": 8, "tags_max": 1})
    s.lookup(request("a", PROMPT, cache_salt="123456789"), 0)
    s.lookup(request("b", PROMPT, cache_salt="12345678"), 0)
    assert [s.lookups[r].miss_reason for r in "ab"] == [MissReason.INVALID_PARAMS, MissReason.NOT_STORED]


def test_the_tenant_book_remembers_a_bounded_number_of_namespaces():
    from connector.engine.tenants import OTHER, TenantBook

    book = TenantBook(max_labels=2, max_namespaces=100)
    labels = [book.label(BASE.with_request(None, f"salt-{i}", {})) for i in range(10_000)]
    assert len(book._by_namespace) <= 100
    assert labels[2:] == [OTHER] * (len(labels) - 2)
    assert book.label(BASE.with_request(None, "salt-0", {})) == labels[0]  # forgotten, same label


def test_the_first_chunk_memory_holds_a_bounded_number_of_namespaces_and_counts_refusals():
    mem = FirstChunkNamespaces(max_namespaces=64)
    for i in range(1000):
        mem.note(first_chunk_fingerprint(list(range(i, i + 256)), 256), BASE.with_request(None, f"s{i}", {}))
    assert len(mem._lists) == 64 and mem.refused == 1000 - 64
    own = BASE.with_request(None, "s0", {})
    assert mem.note(first_chunk_fingerprint(PROMPT, 256), own)  # a namespace it holds: noted


def test_first_chunk_notes_refused_are_counted_under_the_scheduler():
    from .fakes import scheduler

    s = scheduler(extra_config={"namespaces_max": 2})
    for i in range(4):
        admit_fully(s, request(f"r{i}", [i] * 600, cache_salt=f"tenant-{i}"), blocks(10 * i, 5))
    assert s.take_tenant_usage().refusals == {"namespaces_full": 2}


def test_every_refusal_reason_has_a_series():
    from connector.engine.tenants import REFUSAL_REASONS
    from telemetry.metrics import _OWN_DOMAINS, METRICS

    assert METRICS["tenant_refusals"].labels == ("reason",)
    assert _OWN_DOMAINS["tenant_refusal_reasons"] == REFUSAL_REASONS


def test_a_tenant_id_key_in_a_folder_another_user_controls_is_not_taken(tmp_path, monkeypatch):
    """A key planted in a folder this user does not own would let its owner recompute every id."""
    import os

    from connector.scheduler.tenant_id_key import deployment_key

    planted = b"planted-by-someone-else-0123456"
    folder = tmp_path / "disk" / ".kvlens-namespaces"
    folder.mkdir(parents=True)
    (folder / "tenant-id-key").write_bytes(planted)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    (tmp_path / "state").mkdir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 4242)  # both folders: not ours
    key = deployment_key(_config(local_disk=str(tmp_path / "disk")))
    assert key != planted and len(key) >= 16
    assert not list((tmp_path / "state").rglob("tenant-id-key"))  # nothing kept where another user rules


def test_the_admin_token_is_not_written_to_a_folder_another_user_controls(tmp_path, monkeypatch):
    import os

    from connector.scheduler import admin_token

    monkeypatch.setenv(admin_token.DIR_ENV, str(tmp_path))
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path).st_uid + 4242)
    token, _ = admin_token.engine_token(None, None, 8123)
    assert token and not (tmp_path / "admin-8123.token").exists()
