"""Tenant salts: a tenant's namespace comes from a secret the daemon holds, not its name.

A tenant name is a label (it shows in ``ps``, in logs, in a gateway's key file); were it
the salt, anyone who knows it could compute the tenant's keys. The salt is
HMAC-SHA256(secret, name), so names cannot be turned into namespaces, and the label
entries carry (``tenant_id``) is derived from the salt, so it cannot be matched against
a list of guessed names either. Entries without a tenant keep the unsalted namespace.

The secret: ``--tenant-secret-file``; else, with a shared tier, one derived from its
signing key (every host of a fleet must salt alike, or none would find another's
tenant entries); else a random one the daemon creates once in its data directory.
tests/daemon/test_scoped_tokens.py holds the properties.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

from . import keys
from .secrets import SecretFileError, read_secret_file

SECRET_FILE_NAME = "tenant-secret"
MIN_SECRET_BYTES = 16
_SALT_DOMAIN = b"kvcache.tenant-salt.v1\x00"
_FROM_SIGNING_KEY = b"kvcache.tenant-secret-from-signing-key.v1\x00"


class TenantSalts:
    """Pure functions of (secret, tenant name)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a tenant secret needs at least {MIN_SECRET_BYTES} bytes")
        self._secret = secret

    def salt(self, tenant: str) -> str:
        """The salt of ``tenant`` ("" for no tenant)."""
        if not tenant:
            return ""
        return hmac.new(self._secret, _SALT_DOMAIN + tenant.encode(), hashlib.sha256).hexdigest()

    def tenant_id(self, tenant: str) -> str:
        """The label of ``tenant``'s entries ("" for no tenant)."""
        return keys.tenant_id(self.salt(tenant))

    def namespace(self, model_fingerprint: str, kv_layout: Mapping[str, str],
                  tenant: str) -> bytes:
        return keys.namespace(model_fingerprint, kv_layout, self.salt(tenant))


def secret_from_signing_key(signing_key: bytes) -> bytes:
    """A fleet's tenant secret, from the key its hosts already share."""
    return hmac.new(signing_key, _FROM_SIGNING_KEY, hashlib.sha256).digest()


def load_secret_file(path: Path) -> bytes:
    """An operator's tenant secret (owner-only, at least MIN_SECRET_BYTES)."""
    secret = read_secret_file(path, "tenant secret file").rstrip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretFileError(f"the tenant secret in {path} has {len(secret)} bytes; at least "
                              f"{MIN_SECRET_BYTES} are needed (e.g. head -c 32 /dev/urandom "
                              f"| base64 > {path})")
    return secret


def data_dir_secret(root: Path) -> bytes:
    """The secret kept in the data directory, created (random, 0600) on first use."""
    path = root / SECRET_FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return load_secret_file(path)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())
    return load_secret_file(path)
