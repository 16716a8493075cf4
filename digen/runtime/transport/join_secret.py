"""The join secret of a run that takes joining generators: making one, reading one from a
file, and the HMAC proofs by which the driver and a joiner show each other that they know it
(the handshake itself: :mod:`digen.runtime.transport.actors._join`). Torch-free, so a bad
secret is said before anything heavy loads."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from digen.errors import DigenError

__all__ = [
    "MIN_SECRET_CHARS",
    "SECRET_ENV",
    "check_secret",
    "new_secret",
    "proof",
    "proven",
    "read_secret",
]

SECRET_ENV = "DIGEN_JOIN_SECRET"
"""The environment variable ``digen join`` reads the secret from (without ``--secret-file``)."""
MIN_SECRET_CHARS = 16
"""The shortest secret a run or a joiner takes (one a run makes has 43 characters: 256 bits)."""


def new_secret() -> str:
    """A fresh join secret: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def read_secret(path: str | os.PathLike, what: str) -> str:
    """The join secret in the file ``path`` (surrounding white space dropped); ``what`` names
    where the path came from in the one sentence of the ValueError raised when the file
    cannot be read or holds no secret long enough."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not UTF-8 text"
        raise DigenError(f"{what} {str(path)!r} cannot be read: {why.lower()}.") from None
    check_secret(secret, f"{what} {str(path)!r}")
    return secret


def check_secret(secret: str, where: str) -> None:
    """Raise ValueError (one sentence naming ``where``) for a secret too short to keep."""
    if len(secret) < MIN_SECRET_CHARS:
        raise DigenError(
            f"{where} holds a join secret of {len(secret)} characters; use at least "
            f"{MIN_SECRET_CHARS}, e.g. from python -c 'import secrets; "
            "print(secrets.token_urlsafe(32))'."
        )


def proof(secret: str, *parts: str) -> str:
    """HMAC-SHA256 of ``parts`` (as a JSON list: unambiguous) under ``secret``, in hex."""
    message = json.dumps(list(parts)).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def proven(secret: str, given: object, *parts: str) -> bool:
    """Whether ``given`` is :func:`proof` of ``parts``, compared in constant time."""
    if not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode(), proof(secret, *parts).encode())
