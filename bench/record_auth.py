"""What ``extra_config.store_auth_key`` costs a record's write and read, against xxh3 alone.

    python bench/record_auth.py [--quick] [--mb 46] [--layers 32] [--repeats 9]

One payload of ``--mb`` MiB (a chunk of a large model on one rank), laid out in ``--layers``
layers as disk records are. Modes, measured side by side in one process:

- ``xxh3``: a record without a key (the default): xxh3-128 of the payload and xxh3-64 of each
  layer when written (``codec.encode_header``), the payload's checksum when read (``decode``).
- ``keyed``: a record with a store key: BLAKE3 digests of the payload and each layer, a keyed
  BLAKE3 tag over the header (what KVLens does).
- ``header-tag``: xxh3 digests plus the keyed tag over the header only: the cheap variant, which
  KVLens does not use (xxh3 is no cryptographic hash: a writer without the key could change a
  tagged record's payload under its checksums); measured to show what the tag itself costs.
- ``blake2b-payload``: keyed BLAKE2b (hashlib) over the whole payload, written and read: the
  MAC without a new package, for comparison.

Figures: ms to write (digests and header) and ms to read (checks) one record; ratios to xxh3.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import sys
import time
from pathlib import Path

import blake3

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.lib.runner import Benchmark, Figure, Option, Side, main  # noqa: E402
from connector.tiers import codec  # noqa: E402
from connector.tiers.record_trust import RecordTrust  # noqa: E402

NAME = "0123456789abcdef0123456789abcdef.r0"
LAYOUT = "bench-layout"
SECRET = "a-store-key-for-the-benchmark-01"


class RecordAuth(Benchmark):
    name = "record_auth"
    options = {
        "mb": Option(46, 4, "payload MiB"),
        "layers": Option(32, 4, "layers of the payload (one digest each)"),
    }
    figures = (
        Figure("write_ms", "ms to write a record's header", "{:.2f}", ratio=True),
        Figure("read_ms", "ms to check a record read", "{:.2f}", ratio=True),
    )
    baselines = ("xxh3",)
    repeats = (9, 3)

    def sides(self):
        return [Side("xxh3"), Side("keyed"), Side("header-tag"), Side("blake2b-payload")]

    def workload(self):
        return {"payload_mib": self.args.mb, "layers": self.args.layers}

    @contextlib.contextmanager
    def setup(self):
        self.payload = memoryview(bytearray(os.urandom(self.args.mb << 20)))
        self.open = RecordTrust.of(None)
        self.keyed = RecordTrust.of(SECRET)
        self.records = {
            trust: bytearray(codec.encode_header(NAME, LAYOUT, self.payload, "ns", self.args.layers, trust))
            + self.payload
            for trust in (self.open, self.keyed)
        }
        yield

    def measure(self, side, case, rep):
        args, payload, mac_key = self.args, self.payload, self.keyed.key
        t0 = time.perf_counter()
        if side.name == "blake2b-payload":
            hashlib.blake2b(payload, key=mac_key, digest_size=32).hexdigest()
        else:
            trust = self.keyed if side.name == "keyed" else self.open
            header = codec.encode_header(NAME, LAYOUT, payload, "ns", args.layers, trust)
            if side.name == "header-tag":
                blake3.blake3(header, key=mac_key).hexdigest()
        t1 = time.perf_counter()
        if side.name == "blake2b-payload":
            hashlib.blake2b(payload, key=mac_key, digest_size=32).hexdigest()
        else:
            trust = self.keyed if side.name == "keyed" else self.open
            codec.decode(self.records[trust], NAME, LAYOUT, trust)
            if side.name == "header-tag":
                blake3.blake3(header, key=mac_key).hexdigest()
        t2 = time.perf_counter()
        return {"write_ms": (t1 - t0) * 1e3, "read_ms": (t2 - t1) * 1e3}


if __name__ == "__main__":
    sys.exit(main(RecordAuth))
