"""Who may hand a decoder KV: a keyed, mutual handshake and a keyed tag on every chunk.

A chunk key is a hash of tokens and of the model's identity, both of which anyone with the same
public checkpoint can compute, and a peer's ``PeerIdentity`` is public too; xxh3 catches damage,
not intent. So where the PD port is reachable by anyone but the operator's own engines, both
ends share a secret (``pd_auth_key``, its file, or the deployment's ``store_auth_key``) and:

- **prove it with fresh nonces, the receiver first.** The sender's HELLO carries a random nonce;
  the receiver answers with its own and ``proof("receiver", ...)``; the sender checks it before it
  says anything more (a receiver without the key learns nothing, and no KV leaves for it), then
  sends ``proof("sender", ...)`` with its identity; the receiver checks it before it reveals its
  identity or allocates anything (a refused sender learns nothing about the receiver). The two
  proofs are keyed BLAKE3 over a role label and both nonces, so neither can be replayed on
  another connection nor reflected to the other side.
- **tag every chunk.** Each connection derives a session key from the secret and both nonces;
  a chunk's trailer is a 16-byte AES-GCM tag under it, its nonce the transfer's sequence number
  on the connection and the chunk's index, over the proxy's ``req_id``, the chunk's key, token
  count and length (encrypted, discarded) and its bytes (authenticated in place, never copied).
  A chunk moved to another key, index or transfer, replayed on another connection, or changed in
  one byte fails its tag. AES-GCM's tag runs at about 20 GB/s on a core with AES and carry-less
  multiply instructions (VAES/VPCLMULQDQ), three times BLAKE3's and above what one core copies
  through a socket, so each end computes it on its I/O thread as the bytes pass, a piece at a
  time (``begin``; bench/pd_transfer.py measures it). A (sequence, index) pair is never used
  twice under one session key by the sender.

Without a key, the trailer stays the xxh3-64 checksum: damage is caught, a peer is not
authenticated (a receiver then binds loopback only unless ``pd_allow_unauthenticated``).
"""

from __future__ import annotations

import hmac
import os
import struct

import blake3
from cryptography.hazmat.primitives.ciphers import AEADEncryptionContext, Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

NONCE_BYTES = 32
PROOF_BYTES = 32
TAG_BYTES = 16
MIN_KEY_BYTES = 16
_PROOF_CONTEXT = b"KVLens PD handshake proof, version 2"
_SESSION_CONTEXT = "KVLens PD session key, version 2"
_TAG_HEAD = struct.Struct("<IQ")  # tokens, length
_NONCE = struct.Struct("<QI")  # transfer sequence on the connection, chunk index: 12 bytes


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _key32(secret: bytes) -> bytes:
    """The 32-byte BLAKE3 key for a secret of any length (at least MIN_KEY_BYTES)."""
    return blake3.blake3(secret, derive_key_context="KVLens PD shared secret, version 2").digest()


class PDAuth:
    """The shared secret of a PD deployment, and what it proves and tags."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a PD key must be at least {MIN_KEY_BYTES} bytes")
        self._key = _key32(secret)

    def __repr__(self) -> str:  # never the secret, not even in a traceback
        return "PDAuth(<secret>)"

    def proof(self, role: str, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
        """``role`` ("sender" or "receiver") proves the secret over both nonces."""
        h = blake3.blake3(_PROOF_CONTEXT, key=self._key)
        h.update(role.encode() + b"\0" + sender_nonce + receiver_nonce)
        return h.digest(PROOF_BYTES)

    def check(self, role: str, sender_nonce: bytes, receiver_nonce: bytes, given: object) -> bool:
        """Whether ``given`` is ``role``'s proof over these nonces (constant time)."""
        if not isinstance(given, bytes) or len(given) != PROOF_BYTES:
            return False
        return hmac.compare_digest(self.proof(role, sender_nonce, receiver_nonce), given)

    def session(self, sender_nonce: bytes, receiver_nonce: bytes) -> ChunkTags:
        """The chunk tags of one connection (its key derived from the secret and both nonces)."""
        material = self._key + sender_nonce + receiver_nonce
        return ChunkTags(blake3.blake3(material, derive_key_context=_SESSION_CONTEXT).digest(32))


class ChunkTags:
    """AES-GCM tags of one connection's chunks (the ``cryptography`` package, OpenSSL's AES-GCM)."""

    trailer_bytes = TAG_BYTES

    def __init__(self, session_key: bytes) -> None:
        self._aead = AESGCM(session_key)
        self._aes = algorithms.AES(session_key)

    def __repr__(self) -> str:
        return "ChunkTags(<session key>)"

    def tag(self, seq: int, req_id: str, key: str, index: int, tokens: int, data: memoryview) -> bytes:
        """The chunk's tag: its nonce is (``seq``, ``index``), unique on the connection; it binds
        ``req_id``, the key, the token count and the length, and authenticates ``data`` in place."""
        header = _tag_header(req_id, key, tokens, data.nbytes)
        return self._aead.encrypt(_NONCE.pack(seq, index), header, data)[-TAG_BYTES:]

    def begin(self, seq: int, req_id: str, key: str, index: int, tokens: int, nbytes: int) -> RunningTag:
        """The same tag computed as the chunk's ``nbytes`` pass, piece by piece (GCM takes its
        associated data in any number of calls before the encrypted header)."""
        encryptor = Cipher(self._aes, modes.GCM(_NONCE.pack(seq, index))).encryptor()
        return RunningTag(encryptor, _tag_header(req_id, key, tokens, nbytes))

    def matches(self, expected: bytes, given: bytes) -> bool:
        return hmac.compare_digest(expected, given)


class RunningTag:
    """One chunk's AES-GCM tag under way: its bytes as associated data, then the header."""

    __slots__ = ("_encryptor", "_header")

    def __init__(self, encryptor: AEADEncryptionContext, header: bytes) -> None:
        self._encryptor, self._header = encryptor, header

    def update(self, piece: memoryview) -> None:
        self._encryptor.authenticate_additional_data(piece)

    def trailer(self) -> bytes:
        self._encryptor.update(self._header)
        self._encryptor.finalize()
        return self._encryptor.tag


def _tag_header(req_id: str, key: str, tokens: int, nbytes: int) -> bytes:
    names = req_id.encode() + b"\0" + key.encode()
    return _TAG_HEAD.pack(tokens, nbytes) + struct.pack("<H", len(names)) + names
