"""The ``kvlens`` command: inspect and clear KVLens stores, and diagnose running instances.

    kvlens inspect DISK_DIR | REDIS_URL | ADMIN_URL      what is stored, by namespace and age
                                                        (an admin URL: the namespaces only)
    kvlens clear   DISK_DIR | REDIS_URL | ADMIN_URL  (--all | --namespace FP | --model M |
                   --salt S | --tag NAME=VALUE ...)     remove it, all or one namespace
    kvlens doctor  URL [URL ...]                        who can share KV, tier health, sizing,
                                                        whether PD prefillers and decoders pair

A disk directory or a Redis URL (``redis://``, ``rediss://``, ``redis-cluster://``, ...; the
password may come from ``$KVLENS_REDIS_PASSWORD``) is worked on directly; a running engine is
cleared through its admin endpoint (``http://127.0.0.1:<extra_config.admin_port>``), which
applies the clear between steps. The endpoint's token comes from ``--token-file``,
``$KVLENS_ADMIN_TOKEN``, or the file the engine wrote for that port on this host
(``connector/scheduler/admin_token.py``). ``--json`` prints machine-readable output.

``kvlens pd-proxy [LMCache's proxy flags] [--notify-timeout S] ...`` serves the prefill/decode
proxy (docs/disaggregation.md, "The proxy").
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from ..engine.namespace_records import Selector
from ..scheduler.admin_token import TOKEN_ENV, client_token, default_path
from ..tiers.store_records import DiskRecords, RedisRecords, Store, clear
from . import doctor, doctor_pd, inspect_report
from .units import human_bytes

HTTP_TIMEOUT_S = 180.0  # a clear through an engine waits for loads in flight (at most 60 s)
SCRAPE_TIMEOUT_S = 10.0  # doctor's read of one /metrics
TOKEN_HELP = (
    f"the admin endpoint's token file (default: ${TOKEN_ENV}, else the file the engine wrote for the "
    "URL's port under ~/.cache/kvlens)"
)


class UsageError(Exception):
    """A wrong argument, said in one line."""


def _store(target: str, prefix: str) -> Store:
    if "://" not in target:
        return DiskRecords(target)
    from ..tiers.redis_tier import RedisTier
    from ..tiers.remote_url import parse_remote_url

    try:
        url = parse_remote_url(target)
    except ValueError as e:
        raise UsageError(str(e)) from None
    return RedisRecords(RedisTier(url, "", prefix, None, timeout_s=10.0, connect_timeout_s=5.0))


def _is_http(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def _http(url: str, body: dict[str, Any] | None = None, token_file: str | None = None) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET")
    request.add_header("Content-Type", "application/json")
    try:
        token = client_token(url, token_file)
    except OSError as e:
        raise UsageError(f"--token-file: {e}") from None
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            why = json.loads(e.read()).get("error", "")
        except ValueError:
            why = ""
        if e.code == 401:
            port = urllib.parse.urlsplit(url).port or 0
            why += (
                f" (the token: --token-file, ${TOKEN_ENV}, or {default_path(port)} written by an engine"
                " on this host without extra_config.admin_token(_file))"
            )
        raise UsageError(f"{url}: HTTP {e.code} {why}".strip()) from None
    except (urllib.error.URLError, OSError) as e:
        raise UsageError(f"{url}: {getattr(e, 'reason', e)}") from None


def _selector(args: argparse.Namespace) -> Selector:
    salt = args.salt
    if args.salt_env:
        salt = os.environ.get(args.salt_env)
        if salt is None:
            raise UsageError(f"--salt-env: ${args.salt_env} is not set")
    tags = []
    for tag in args.tag or []:
        name, sep, value = tag.partition("=")
        if not sep or not name:
            raise UsageError(f"--tag {tag!r}: write NAME=VALUE")
        tags.append((name, value))
    fingerprints = frozenset(args.namespace or [])
    selector = Selector(fingerprints, args.model, salt, tuple(sorted(tags)))
    if selector.everything != bool(args.all):
        raise UsageError("say what to clear: --all, or one of --namespace, --model, --salt, --tag (not both)")
    try:  # the same checks the admin endpoint makes
        Selector.from_json({**selector.to_json(), "all": bool(args.all)})
    except ValueError as e:
        raise UsageError(str(e)) from None
    return selector


def cmd_inspect(args: argparse.Namespace) -> int:
    if _is_http(args.target):
        reply = _http(args.target.rstrip("/") + "/kvlens/namespaces", token_file=args.token_file)
        print(json.dumps(reply, indent=2) if args.json else _namespaces_text(reply))
        return 0
    store = _store(args.target, args.prefix)
    records, damaged = store.namespaces()
    report = inspect_report.summarise(
        repr(store), store.chunks(verify=args.verify), records, damaged, time.time()
    )
    print(json.dumps(report.to_json(), indent=2) if args.json else inspect_report.text(report))
    return 0


def _namespaces_text(reply: dict[str, Any]) -> str:
    lines = ["namespaces known to the engine and its stores:"]
    for ns in reply.get("namespaces", []):
        mark = " (stored by this engine)" if ns.get("this_engine") else ""
        tags = ",".join(ns.get("tag_names", [])) or "-"
        salted = "yes" if ns.get("salted") else "no"
        lines.append(f"  {ns['fingerprint']}  salted {salted}  tags {tags}  model {ns['model'][:60]}{mark}")
    lines.append(
        "chunks, bytes, ages and damaged records: kvlens inspect on the engine's disk directory or "
        "Redis URL (its admin endpoint lists namespaces only)"
    )
    return "\n".join(lines)


def cmd_clear(args: argparse.Namespace) -> int:
    selector = _selector(args)
    if _is_http(args.target):
        body = {**selector.to_json(), "all": selector.everything}
        result = _http(args.target.rstrip("/") + "/kvlens/clear", body, args.token_file)
    else:
        store = _store(args.target, args.prefix)
        result = {"where": repr(store), "selection": selector.describe(), **clear(store, selector).to_json()}
    print(json.dumps(result, indent=2) if args.json else _clear_text(result))
    return 0


def _clear_text(result: dict[str, Any]) -> str:
    if "engine" not in result:
        return (
            f"{result['where']}: cleared {result['selection']}: {result['chunks']} chunks, "
            f"{result['records']} records, {human_bytes(result['bytes'])}; "
            f"namespace records removed: {len(result['namespaces'])}"
        )
    engine = result["engine"]
    lines = [f"cleared {result['selection']} through the engine"]
    if not engine.get("applied"):
        lines.append("  the engine did not step within 30 s: its index drops the chunks when it next does")
    dropped = ", ".join(f"{t} {n}" for t, n in engine.get("index_dropped", {}).items()) or "nothing"
    lines.append(
        f"  index: dropped {dropped} chunks (waited for {engine.get('waited_for', 0)} requests' loads)"
    )
    for tier in ("disk", "remote"):
        if tier in result:
            r = result[tier]
            if "error" in r:
                lines.append(f"  {tier}: failed: {r['error']}")
            else:
                lines.append(f"  {tier}: removed {r['chunks']} chunks, {human_bytes(r['bytes'])}")
    return "\n".join(lines)


def _scrape(url: str) -> list[doctor.Sample]:
    from prometheus_client.parser import text_string_to_metric_families

    target = url if url.rstrip("/").endswith("/metrics") else url.rstrip("/") + "/metrics"
    with urllib.request.urlopen(target, timeout=SCRAPE_TIMEOUT_S) as r:
        body = r.read().decode()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(body) for s in f.samples]


def cmd_doctor(args: argparse.Namespace) -> int:
    found: list[doctor.Instance] = []
    unreachable: dict[str, str] = {}
    for url in args.urls:
        try:
            samples = _scrape(url)
        except (urllib.error.URLError, OSError, ValueError) as e:
            unreachable[url] = str(getattr(e, "reason", e))
            continue
        engines = doctor.instances(url, samples)
        if not engines:
            unreachable[url] = doctor.why_no_instance(samples)
        found += engines
    result = doctor.diagnose(found, unreachable, probe=doctor_pd.tcp_probe)
    print(json.dumps(result.to_json(), indent=2) if args.json else doctor.text(result))
    return 2 if unreachable else 1 if any(not p.can_pair for p in result.pd) else 0


def cmd_pd_proxy(args: argparse.Namespace) -> int:
    from ..pd_proxy.backends import settings_from_args
    from ..pd_proxy.server import run

    settings = settings_from_args(args)
    problems = settings.problems()
    if problems:
        raise UsageError("; ".join(problems))
    return run(settings)


class DefaultsShown(argparse.HelpFormatter):
    """Every option's default in its help, as argparse's ArgumentDefaultsHelpFormatter writes it,
    but never "(default: None)" or "(default: False)", and a list as it is typed (8300,8301)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS:
            return text
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


DOCTOR_DESCRIPTION = (
    f"Reads each URL's /metrics ({SCRAPE_TIMEOUT_S:g} s each) and says which instances can share KV "
    "and why others cannot, how their tiers are, what the what-if curves advise, and whether each PD "
    "prefiller can pair with each decoder. For a pair that can, it connects to the decoder's PD ports "
    f"and the prefiller's proxy from here ({doctor_pd.PROBE_TIMEOUT_S:g} s each) and closes at once: "
    "nothing is sent, and the decoder counts no failure. Exit status 0; 1 when a PD pair cannot pair; "
    "2 when a URL could not be read or runs no KVLens."
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvlens", description="Inspect and clear KVLens stores; diagnose running instances."
    )
    sub = p.add_subparsers(dest="command", required=True)
    target = "a disk tier directory, a Redis URL, or a running engine's admin URL (http://...)"
    json_help = "print machine-readable JSON"

    ins = sub.add_parser(
        "inspect",
        help="what a store holds: chunks, bytes, namespaces, ages, damage (an admin URL: its namespaces)",
        formatter_class=DefaultsShown,
    )
    ins.add_argument("target", help=target + "; an admin URL lists the namespaces only")
    ins.add_argument("--prefix", default="kvlens", help="Redis key prefix (extra_config.remote_key_prefix)")
    ins.add_argument("--verify", action="store_true", help="read whole records and check their checksums")
    ins.add_argument("--token-file", help=TOKEN_HELP)
    ins.add_argument("--json", action="store_true", help=json_help)
    ins.set_defaults(run=cmd_inspect)

    clr = sub.add_parser(
        "clear",
        help="remove stored KV: everything, or one model / tag / salt namespace",
        formatter_class=DefaultsShown,
    )
    clr.add_argument("target", help=target)
    clr.add_argument("--prefix", default="kvlens", help="Redis key prefix (extra_config.remote_key_prefix)")
    clr.add_argument("--all", action="store_true", help="everything under the directory or prefix")
    clr.add_argument("--namespace", action="append", metavar="FP", help="a key fingerprint (kvlens inspect)")
    clr.add_argument("--model", help="model weights: ckpt:<digest> or a digest prefix, named:<name>, ...")
    clr.add_argument("--salt", help="the namespace of this cache_salt (see --salt-env)")
    clr.add_argument("--salt-env", metavar="VAR", help="read the salt from this environment variable")
    clr.add_argument("--tag", action="append", metavar="NAME=VALUE", help="lmcache.tag.NAME=VALUE (repeat)")
    clr.add_argument("--token-file", help=TOKEN_HELP)
    clr.add_argument("--json", action="store_true", help=json_help)
    clr.set_defaults(run=cmd_clear)

    doc = sub.add_parser(
        "doctor",
        help="which instances can share KV, tier health, what-if advice, whether PD prefillers and "
        "decoders can pair (exit 1 when one cannot)",
        description=DOCTOR_DESCRIPTION,
        formatter_class=DefaultsShown,
    )
    doc.add_argument(
        "urls",
        nargs="+",
        metavar="URL",
        help="vLLM server URLs (their /metrics, or the URL as given when it ends in /metrics)",
    )
    doc.add_argument("--json", action="store_true", help=json_help)
    doc.set_defaults(run=cmd_doctor)

    from ..pd_proxy.backends import add_arguments

    pdp = sub.add_parser(
        "pd-proxy",
        help="prefill/decode proxy: LMCache's example proxy's protocol and flags, a bounded wait, metrics",
        formatter_class=DefaultsShown,
    )
    add_arguments(pdp)
    pdp.set_defaults(run=cmd_pd_proxy)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code = args.run(args)
        sys.stdout.flush()  # a reader that left shows here, not in Python's flush at exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except UsageError as e:
        print(f"kvlens {args.command}: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"kvlens {args.command}: {e}", file=sys.stderr)
        return 1


def _reader_gone() -> int:
    """``kvlens inspect DIR | head``: the reader left before the report ended. Said nowhere, as a
    Unix tool says nothing (it dies of SIGPIPE: status 128 + 13); stdout goes to /dev/null so
    that Python's own flush at exit has nothing left to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a file descriptor (embedded, tests)
        pass
    return 128 + signal.SIGPIPE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
