"""``kvlens inspect`` and ``kvlens clear`` on a disk directory (Redis: tests/redis)."""

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from connector.engine.keys import Namespace, key_fingerprint, storage_name
from connector.engine.namespace_records import NamespaceRecord
from connector.ops.cli import main
from connector.tiers import codec
from connector.tiers.disk import DiskTier, chunk_path
from connector.tiers.store_records import DiskRecords

from .fakes import IDENTITY

BASE = Namespace(IDENTITY.key(), "bfloat16", "L", 2)
SALTED = BASE.with_request(None, "tenant-secret", {})
TAGGED = BASE.with_request(None, None, {"team": "blue"})


def _digest(i: int) -> str:
    return f"{i:032x}"


def _fill(root, namespace, first, n, ranks=2, size=1000):
    tier = DiskTier(str(root), "L")
    for i in range(first, first + n):
        for r in range(ranks):
            tier.put(storage_name(_digest(i), r), memoryview(os.urandom(size)), key_fingerprint(namespace))
    DiskRecords(str(root)).write_namespace(NamespaceRecord.of(namespace, 256))


@pytest.fixture
def store(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    _fill(root, BASE, 0, 3)
    _fill(root, SALTED, 10, 2)
    _fill(root, TAGGED, 20, 1)
    # a record an older KVLens wrote (no namespace), and one damaged on disk
    old = b"x" * 1000
    header = json.dumps(
        {"name": storage_name(_digest(30), 0), "layout": "L", "nbytes": 1000, "xxh3": codec.checksum(old)}
    ).encode()
    (root / f"{_digest(30)}.r0.kvlens").write_bytes(
        codec.MAGIC + len(header).to_bytes(4, "little") + header + old
    )
    damaged = Path(chunk_path(str(root), storage_name(_digest(0), 1)))
    damaged.write_bytes(damaged.read_bytes()[:-10])
    (root / "notes.txt").write_text("not ours")
    return root


def _run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_counts_chunks_by_namespace_ages_and_damage(store, capsys):
    code, out, _ = _run(capsys, "inspect", str(store), "--json")
    report = json.loads(out)
    assert code == 0 and report["chunks"] == 7 and report["records"] == 13 and report["damaged_records"] == 1
    assert report["damaged_examples"][0]["record"] == storage_name(_digest(0), 1)
    by_fp = {n["fingerprint"]: n for n in report["namespaces"]}
    base, salted = by_fp[key_fingerprint(BASE)], by_fp[key_fingerprint(SALTED)]
    assert base["chunks"] == 3 and base["records"] == 5 and not base["salted"] and base["world_size"] == 2
    assert base["model"] == IDENTITY.weights and base["quantization"] == "none"
    assert salted["chunks"] == 2 and salted["salted"] and salted["tags"] == []
    assert by_fp[key_fingerprint(TAGGED)]["tags"] == ["team"]
    assert by_fp[None]["chunks"] == 1 and not by_fp[None]["described"]  # the older record
    assert report["age_histogram"]["< 1 min"] == 13
    assert "tenant-secret" not in out and "blue" not in out


def test_inspect_text_names_what_a_person_looks_for(store, capsys):
    code, out, _ = _run(capsys, "inspect", str(store))
    assert code == 0 and "7 chunks in 13 records" in out and key_fingerprint(SALTED) in out
    assert "damaged records: 1" in out and "age of records" in out


def test_inspect_verify_reads_payloads_and_finds_a_flipped_byte(store, capsys):
    path = Path(chunk_path(str(store), storage_name(_digest(10), 0)))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    assert json.loads(_run(capsys, "inspect", str(store), "--json")[1])["damaged_records"] == 1
    assert json.loads(_run(capsys, "inspect", str(store), "--json", "--verify")[1])["damaged_records"] == 2


def test_clear_by_salt_takes_only_that_namespace_and_its_record(store, capsys):
    code, out, _ = _run(capsys, "clear", str(store), "--salt", "tenant-secret", "--json")
    result = json.loads(out)
    assert code == 0 and result["chunks"] == 2 and result["records"] == 4
    assert result["namespaces"] == [key_fingerprint(SALTED)] and "tenant-secret" not in out
    left = {r.namespace for r in DiskRecords(str(store)).chunks()}
    assert key_fingerprint(SALTED) not in left and key_fingerprint(BASE) in left
    records = {r.fingerprint for r in DiskRecords(str(store)).namespaces()[0]}
    assert records == {key_fingerprint(BASE), key_fingerprint(TAGGED)}


def test_clear_by_tag_by_model_and_by_fingerprint(store, capsys):
    assert json.loads(_run(capsys, "clear", str(store), "--tag", "team=red", "--json")[1])["chunks"] == 0
    assert json.loads(_run(capsys, "clear", str(store), "--tag", "team=blue", "--json")[1])["chunks"] == 1
    fp = key_fingerprint(SALTED)[:8]
    assert json.loads(_run(capsys, "clear", str(store), "--namespace", fp, "--json")[1])["chunks"] == 2
    digest = IDENTITY.weights.split(":")[1][:8]
    assert json.loads(_run(capsys, "clear", str(store), "--model", digest, "--json")[1])["chunks"] == 3
    left = [r.name for r in DiskRecords(str(store)).chunks()]
    assert left == [storage_name(_digest(30), 0)]  # a record of unknown namespace: only --all takes it


def test_clear_all_removes_every_record_and_nothing_else(store, capsys):
    code, out, _ = _run(capsys, "clear", str(store), "--all")
    assert code == 0 and "7 chunks" in out
    left = {f for f in os.listdir(store) if not (store / f).is_dir() or any((store / f).iterdir())}
    assert left - {".kvlens-namespaces"} == {"notes.txt"}  # empty subdirectories of the layout stay
    assert list(DiskRecords(str(store)).chunks()) == [] and DiskRecords(str(store)).namespaces() == ([], [])


def test_clear_must_be_told_what_to_clear(store, capsys):
    code, _, err = _run(capsys, "clear", str(store))
    assert code == 1 and "say what to clear" in err
    code, _, err = _run(capsys, "clear", str(store), "--all", "--salt", "x")
    assert code == 1
    code, _, err = _run(capsys, "clear", str(store), "--tag", "novalue")
    assert code == 1 and "NAME=VALUE" in err
    assert len(list(DiskRecords(str(store)).chunks())) == 13


def test_a_missing_directory_is_a_clear_error(tmp_path, capsys):
    code, _, err = _run(capsys, "inspect", str(tmp_path / "nope"))
    assert code == 1 and "no such directory" in err and not (tmp_path / "nope").exists()


def test_records_written_after_the_cutoff_are_left_alone(store):
    from connector.engine.namespace_records import Selector
    from connector.tiers.store_records import clear

    cutoff = time.time() - 3600
    assert clear(DiskRecords(str(store)), Selector(), before_s=cutoff).chunks == 0


def test_inspect_into_a_closed_pipe_exits_quietly_as_unix_tools_do(store):
    """``kvlens inspect DIR | head``: the reader leaves early; no "[Errno 32] Broken pipe", no
    traceback, the status a tool killed by SIGPIPE has (128 + 13)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    read, write = os.pipe()
    os.close(read)  # the reader is gone before kvlens writes a byte
    try:
        done = subprocess.run(
            [sys.executable, "-m", "connector.ops.cli", "inspect", str(store)],
            stdout=write,
            stderr=subprocess.PIPE,
            cwd=repo,
            env={**os.environ, "PYTHONPATH": str(repo)},
            timeout=120,
        )
    finally:
        os.close(write)
    assert done.stderr.decode() == "" and done.returncode == 141


def test_inspect_on_an_admin_url_lists_namespaces_and_says_where_chunks_bytes_and_ages_are(tmp_path, capsys):
    """The admin endpoint serves namespace records only (GET /kvlens/namespaces): the report says
    so instead of leaving chunks, bytes and ages unsaid."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    record = json.loads(NamespaceRecord.of(TAGGED, 256).to_json())
    body = json.dumps({"namespaces": [{**record, "this_engine": True}]}).encode()

    class Admin(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            ok = self.path == "/kvlens/namespaces" and self.headers["Authorization"] == "Bearer t"
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    token = tmp_path / "token"
    token.write_text("t")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        code, out, _ = _run(capsys, "inspect", url, "--token-file", str(token))
    finally:
        server.shutdown()
    assert code == 0
    assert f"{key_fingerprint(TAGGED)}  salted no  tags team" in out and "(stored by this engine)" in out
    assert out.rstrip().endswith(
        "chunks, bytes, ages and damaged records: kvlens inspect on the engine's disk directory or "
        "Redis URL (its admin endpoint lists namespaces only)"
    )


def _help(command: str) -> tuple[argparse.ArgumentParser, str]:
    from connector.ops.cli import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    return sub, " ".join(sub.format_help().split())


@pytest.mark.parametrize("command", ["inspect", "clear", "doctor", "pd-proxy"])
def test_every_option_with_a_default_shows_it_in_help(command):
    sub, text = _help(command)
    for action in sub._actions:
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS:
            continue
        shown = ",".join(map(str, default)) if isinstance(default, list) else str(default)
        assert f"(default: {shown})" in text, (action.option_strings, text)
    assert "(default: None)" not in text and "(default: False)" not in text


def test_doctor_help_says_what_it_reads_how_long_it_waits_and_what_its_status_means():
    _, text = _help("doctor")
    assert "/metrics (10 s each)" in text and "2 s each" in text and "nothing is sent" in text
    assert "Exit status 0; 1 when a PD pair cannot pair; 2 when a URL could not be read" in text
