"""Who is at each end of a PD transfer, and whether the two ends can pair.

A prefiller rank may hand its records to a decoder rank only when both would name the same chunk
with the same key and lay its bytes out alike: same key space (model, weights, KV settings,
dtype...), same TP size and rank (rank r sends to rank r), block size, chunk size and record
layout. The handshake exchanges a ``PeerIdentity`` and both sides name every field that differs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

MAX_TEXT = 512  # a key space digest or a layout string longer than this is not one KVLens wrote


@dataclass(frozen=True, slots=True)
class PeerIdentity:
    key_space: str  # digest of what chunk keys depend on besides tokens; equal on P and D
    tp_size: int
    tp_rank: int  # rank r of the prefiller sends to rank r of the decoder
    block_size: int
    chunk_size: int
    record_layout: str  # dtype, layers, kv heads per rank, head size, record format version

    def differences(self, other: PeerIdentity) -> list[str]:
        """Names of the fields that differ, in declaration order ([] when the two can pair)."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def to_wire(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_wire(cls, data: object) -> PeerIdentity:
        """The identity a peer sent; ``ValueError`` for anything that is not one."""
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            raise ValueError("not a peer identity")
        for f in fields(cls):
            value = data[f.name]
            if f.type == "int":
                if type(value) is not int or not 0 <= value < 2**31:
                    raise ValueError(f"peer identity field {f.name} is not a small integer")
            elif type(value) is not str or len(value) > MAX_TEXT:
                raise ValueError(f"peer identity field {f.name} is not a short string")
        return cls(**data)


def mismatch_reason(names: list[str]) -> str:
    """The refusal reason naming the differing fields: ``mismatch:tp_size,block_size``."""
    return "mismatch:" + ",".join(names)
