"""Signed weight pushes: only a trainer identity can make an engine take weights.

The WeightSync bearer token admits a caller to the stack, and every engine holds it (an engine
relays pushes to others). What says *the trainer* sent a push is an Ed25519 signature over the
push's header — its version, fencing token, sender, tensor manifest, delta base and the sha256 of
the weights after the push — made with a private key only trainer identities hold
(`libra_weight_sync_signing_key`); engines hold the public keys (`libra_weight_sync_trainers`,
identity → key). Relays forward the header unchanged but for its `relay` subtree, which the
signature leaves out: the tree is routing, and every hop checks the signature again. The engine
also checks that the signed sender holds the trainer lease with the signed fencing token
(services/rollout_engine/weight_sync.py), so a stolen header of an old version is refused, and the
signed checksum is recomputed from what the engine holds before the version is taken.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from services.common.contracts import ws

DOMAIN = b"libra.weightsync.v1/header\x00"
"""Prefixed to what is signed, so a signature over a header is never valid for anything else."""


class SignatureError(Exception):
    """The push's header is unsigned, signed by no trainer this engine knows, or not as signed."""


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_signing_key() -> str:
    """A fresh private key, as the secret file holds it (base64url of the raw 32 bytes)."""
    return _b64(Ed25519PrivateKey.generate().private_bytes_raw())


def public_key(signing_key: str) -> str:
    """The public half of `signing_key`, in the same encoding."""
    return _b64(Ed25519PrivateKey.from_private_bytes(_unb64(signing_key)).public_key().public_bytes_raw())


def signed_bytes(header: ws.WeightHeader) -> bytes:
    """What the signature covers: the header without its relay subtree and its signature."""
    bare = ws.WeightHeader()
    bare.CopyFrom(header)
    del bare.relay[:]
    bare.signature = b""
    return DOMAIN + bare.SerializeToString(deterministic=True)


class HeaderSigner:
    def __init__(self, signing_key: str):
        try:
            self._key = Ed25519PrivateKey.from_private_bytes(_unb64(signing_key))
        except ValueError as err:
            raise ValueError(f"weight_sync_signing_key is not an Ed25519 key: {err}") from None

    def sign(self, header: ws.WeightHeader) -> ws.WeightHeader:
        header.signature = self._key.sign(signed_bytes(header))
        return header


class HeaderVerifier:
    """Checks a header's signature against the key of the trainer identity it names as sender:
    the worker's own identity in a stack with one per worker, else the shared `trainer` one."""

    def __init__(self, trainers: Mapping[str, str]):
        if not trainers:
            raise ValueError("weight_sync_trainers names no trainer key")
        self._keys: dict[str, Ed25519PublicKey] = {}
        for name, key in trainers.items():
            try:
                self._keys[name] = Ed25519PublicKey.from_public_bytes(_unb64(key))
            except ValueError as err:
                raise ValueError(
                    f"weight_sync_trainers[{name!r}] is not an Ed25519 public key: {err}"
                ) from None

    @classmethod
    def from_json(cls, text: str) -> HeaderVerifier:
        try:
            trainers = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"weight_sync_trainers is not JSON: {err}") from None
        if not isinstance(trainers, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in trainers.items()
        ):
            raise ValueError("weight_sync_trainers must map trainer identities to keys")
        return cls(trainers)

    def verify(self, header: ws.WeightHeader) -> None:
        key = self._keys.get(header.sender_id) or self._keys.get("trainer")
        if key is None:
            raise SignatureError(f"sender {header.sender_id!r} is no trainer identity this engine knows")
        if not header.signature:
            raise SignatureError("the push is not signed")
        try:
            key.verify(header.signature, signed_bytes(header))
        except InvalidSignature:
            raise SignatureError(f"the header's signature is not {header.sender_id!r}'s") from None


def trainers_json(keys: Mapping[str, str]) -> str:
    """`libra_weight_sync_trainers`: trainer identity → public key."""
    return json.dumps(dict(sorted(keys.items())))
