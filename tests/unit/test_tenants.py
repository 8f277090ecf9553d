"""Per-tenant accounting: ids that never carry a salt, bounded labels, bytes held that follow
the tiers, and counts that add up to the responses' own."""

from connector.engine.jobs import CPU, DISK
from connector.engine.keys import Namespace
from connector.engine.outcomes import ChunkLoadResult, LoadOutcome, WorkerReport
from connector.engine.tenants import DEFAULT, OTHER, TenantBook, tenant_id, value_id

from .fakes import BLOCK_BYTES, LAYERS, admit_fully, blocks, cpu_gb, request, scheduler, step

BASE = Namespace("m", "bf16", "layout")
PROMPT = list(range(1000, 1600))  # two whole chunks and a tail
CHUNK_BYTES = 2 * BLOCK_BYTES * LAYERS  # a 256-token chunk: two blocks


def salted(salt: str) -> Namespace:
    return BASE.with_request(None, salt, {})


def test_tenant_ids_name_no_salt_and_no_tag_value():
    secret = "sk-tenant-alice-0123456789"
    salt_id = tenant_id(salted(secret))
    assert salt_id == f"salt:{value_id(secret)}" and len(value_id(secret)) == 16  # 64 bits
    assert secret not in salt_id
    tagged = tenant_id(BASE.with_request(None, None, {"user": "alice", "team": "ml"}))
    assert tagged == f"team:{value_id('ml')},user:{value_id('alice')}"
    assert "alice" not in tagged
    assert tenant_id(BASE) == DEFAULT and tenant_id(None) == DEFAULT
    assert tenant_id(BASE.with_request("lora-name:x", None, {})) == DEFAULT  # a LoRA is no tenant
    assert tenant_id(salted("a")) != tenant_id(salted("b"))


def test_tag_names_are_cut_to_a_safe_short_label():
    odd = tenant_id(BASE.with_request(None, None, {"a|b c" + "x" * 60: "v"}))
    name = odd.split(":")[0]
    assert "|" not in odd and " " not in odd and len(name) == 32


def test_first_tenants_keep_their_labels_and_later_ones_count_as_other():
    book = TenantBook(max_labels=2)
    a, b, c = salted("a"), salted("b"), salted("c")
    assert book.label(a) == tenant_id(a)
    assert book.label(BASE) == DEFAULT  # default takes no slot
    assert book.label(b) == tenant_id(b)
    assert book.label(c) == OTHER
    for _ in range(3):  # c's later activity never takes a's label: no flapping, no reset counters
        book.label(c)
    assert book.label(a) == tenant_id(a) and book.label(c) == OTHER
    assert book.labels() == [DEFAULT, tenant_id(a), tenant_id(b), OTHER]


def test_zero_labels_counts_every_salted_tenant_as_other():
    book = TenantBook(max_labels=0)
    assert book.label(salted("a")) == OTHER and book.label(BASE) == DEFAULT


def test_counters_are_deltas_per_label_and_bytes_stay():
    book = TenantBook(max_labels=4, tiers=(CPU,))
    book.open("r1", salted("a"))
    book.looked_up("r1", 600, 512)
    book.loaded("r1", 511)
    book.held(CPU, "k1", book.request_label("r1"), 100)
    first = book.take()
    label = tenant_id(salted("a"))
    assert first.lookup_tokens == {label: 600} and first.hit_tokens == {label: 512}
    assert first.load_tokens == {label: 511}
    assert first.bytes_held == {(DEFAULT, CPU): 0, (OTHER, CPU): 0, (label, CPU): 100}
    book.dropped(CPU, "k1")
    book.dropped(CPU, "not-mine")  # another engine's chunk: ignored
    second = book.take()
    assert not second.lookup_tokens and second.bytes_held[(label, CPU)] == 0


def test_a_closed_request_counts_as_default():
    book = TenantBook(max_labels=4)
    book.open("r1", salted("a"))
    book.close("r1")
    book.looked_up("r1", 10, 0)
    assert book.take().lookup_tokens == {DEFAULT: 10}


def _serve(s, rid, salt, first_block):
    r = request(rid, PROMPT, cache_salt=salt)
    need, plan = admit_fully(s, r, blocks(first_block, 5))
    if plan.loads:
        (job,) = plan.loads
        out = LoadOutcome(
            rid, [ChunkLoadResult(c.name, c.tier, c.num_tokens, tier=c.tier) for c in job.chunks]
        )
        s.on_worker_report(WorkerReport(loads={rid: out}))
    return s.finish(r).params["num_lmcache_cached_tokens"]


def test_scheduler_counts_hits_and_loads_per_salt_as_the_responses_report():
    s = scheduler()
    cached = {"alice": 0, "bob": 0}
    for i, (rid, salt) in enumerate([("a1", "alice"), ("b1", "bob"), ("a2", "alice"), ("a3", "alice")]):
        cached[salt] += _serve(s, rid, salt, 10 * i)
    s.take_done()
    usage = s.take_tenant_usage()
    alice, bob = tenant_id(salted("alice")), tenant_id(salted("bob"))
    assert usage.hit_tokens == {alice: cached["alice"], bob: cached["bob"]} == {alice: 1024, bob: 0}
    assert usage.lookup_tokens == {alice: 3 * 600, bob: 600}
    assert usage.load_tokens == {alice: 1024}
    assert usage.bytes_held[(alice, CPU)] == usage.bytes_held[(bob, CPU)] == 2 * CHUNK_BYTES
    assert usage.bytes_held[(DEFAULT, CPU)] == 0
    assert sum(n for (_, tier), n in usage.bytes_held.items() if tier == CPU) == s.tiers[CPU].used_bytes


def test_evictions_and_resets_take_bytes_from_the_tenant_that_held_them():
    s = scheduler(max_local_cpu_size=cpu_gb(2 * CHUNK_BYTES))  # room for one tenant's prompt
    _serve(s, "a1", "alice", 0)
    _serve(s, "b1", "bob", 10)  # evicts alice's chunks
    usage = s.take_tenant_usage()
    alice, bob = tenant_id(salted("alice")), tenant_id(salted("bob"))
    assert usage.bytes_held[(alice, CPU)] == 0 and usage.bytes_held[(bob, CPU)] == 2 * CHUNK_BYTES
    s.reset()
    assert s.take_tenant_usage().bytes_held[(bob, CPU)] == 0


def test_a_salted_response_names_its_tenant_id_and_a_default_one_none():
    s = scheduler()
    r = request("a1", PROMPT, cache_salt="alice")
    admit_fully(s, r, blocks(0, 5))
    assert s.finish(r).params["kvlens"]["tenant"] == tenant_id(salted("alice"))
    d = request("d1", PROMPT)
    admit_fully(s, d, blocks(10, 5))
    assert "tenant" not in s.finish(d).params["kvlens"]


def test_tenant_labels_max_is_a_setting():
    s = scheduler(extra_config={"tenant_labels_max": 1})
    _serve(s, "a1", "alice", 0)
    _serve(s, "b1", "bob", 10)
    usage = s.take_tenant_usage()
    assert set(usage.lookup_tokens) == {tenant_id(salted("alice")), OTHER}


def test_a_chunk_promoted_from_disk_counts_for_its_tenant_in_the_cpu_tier(tmp_path):
    s = scheduler(local_disk=str(tmp_path), max_local_disk_size=1)
    _, plan = admit_fully(s, request("a", PROMPT, cache_salt="alice"), blocks(0, 5))
    alice = tenant_id(salted("alice"))
    usage = s.take_tenant_usage()
    assert usage.bytes_held[(alice, CPU)] == usage.bytes_held[(alice, DISK)] == 2 * CHUNK_BYTES
    s.tiers[CPU].remove(plan.stores[1].name)  # leaves the CPU tier: alice holds less there
    assert s.take_tenant_usage().bytes_held[(alice, CPU)] == CHUNK_BYTES
    c = request("c", PROMPT, cache_salt="alice")
    s.after_alloc(c, s.lookup(c, 0), blocks(10, 5))  # the disk chunk loads, and is kept in CPU
    (job,) = [j for j in s.build_plan(step()).async_loads if j.request_id == "c"]
    assert [ch.promote_to for ch in job.chunks] == [(), (CPU,)]
    assert s.take_tenant_usage().bytes_held[(alice, CPU)] == 2 * CHUNK_BYTES == s.tiers[CPU].used_bytes
    s.shutdown()
