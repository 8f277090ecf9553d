"""Plain stand-ins for the few vLLM objects the scheduler half reads."""

from __future__ import annotations

from types import SimpleNamespace

from connector.config.loading import load_config
from connector.engine.facts import EngineFacts, ModelIdentity
from connector.scheduler.connector_scheduler import ConnectorScheduler

BLOCK = 128
BLOCK_BYTES = 1000  # per layer
LAYERS = 2


def gb(nbytes: int) -> float:
    return nbytes / 1024**3


def cpu_gb(nbytes: int) -> float:
    """``max_local_cpu_size`` for a CPU tier of ``nbytes`` (chunks may use the whole budget)."""
    return gb(nbytes)


IDENTITY = ModelIdentity("ckpt:0123456789abcdef", "c0ffee", "bfloat16", "none", "auto")


def facts(role: str = "kv_both") -> EngineFacts:
    return EngineFacts(
        IDENTITY.key(), "bfloat16", BLOCK, LAYERS, BLOCK_BYTES, "test-layout", 1, role, identity=IDENTITY
    )


def scheduler(role: str = "kv_both", **extra) -> ConnectorScheduler:
    config = load_config({f"lmcache.{k}": v for k, v in extra.items()}, env={})
    return ConnectorScheduler(config, facts(role))


def request(rid: str, tokens: list[int], **kw) -> SimpleNamespace:
    r = SimpleNamespace(
        request_id=rid,
        all_token_ids=list(tokens),
        prompt_token_ids=list(tokens),
        kv_transfer_params=None,
        priority=0,
        cache_salt=None,
        lora_request=None,
        mm_features=None,
        prompt_embeds=None,
    )
    r.__dict__.update(kw)
    r.num_tokens = len(r.all_token_ids)
    r.num_prompt_tokens = kw.get("num_prompt_tokens", len(r.prompt_token_ids))
    return r


def step(new=(), cached=(), num_scheduled=None):
    """A SchedulerOutput: ``new`` = [(request, block_ids, num_computed)],
    ``cached`` = [(rid, new_block_ids | None, num_computed, resumed)]."""
    new_reqs = [
        SimpleNamespace(
            req_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            block_ids=(list(b),),
            num_computed_tokens=c,
        )
        for r, b, c in new
    ]
    cached_reqs = SimpleNamespace(
        req_ids=[c[0] for c in cached],
        resumed_req_ids={c[0] for c in cached if c[3]},
        new_block_ids=[(list(c[1]),) if c[1] is not None else None for c in cached],
        num_computed_tokens=[c[2] for c in cached],
    )
    return SimpleNamespace(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=cached_reqs,
        num_scheduled_tokens=num_scheduled or {},
    )


def blocks(first: int, n: int) -> list[int]:
    return list(range(first, first + n))


def admit_fully(sched: ConnectorScheduler, req, block_ids, local_hit: int = 0):
    """lookup -> alloc -> one step that computes the whole prompt; returns (need, plan)."""
    need = sched.lookup(req, local_hit)
    sched.after_alloc(req, need)
    plan = sched.build_plan(
        step(
            new=[(req, block_ids, local_hit + need)],
            num_scheduled={req.request_id: req.num_tokens - local_hit - need},
        )
    )
    return need, plan
