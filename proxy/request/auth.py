"""Who a request is: the API key it carries, its tenant (or admin), and the key's expiry."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from proxy.api.errors import ProxyError, admin_disabled, key_expired, unauthorized
from proxy.config.schema import LoadedConfig
from proxy.config.tenants import Tenant, hash_key


def api_key_from(headers: Mapping[str, str]) -> str | None:
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    key = headers.get("api-key", "").strip()
    return key or None


def _check_expiry(loaded: LoadedConfig, digest: str, wall: Callable[[], float]) -> None:
    """401 for a known key past its ``expires_at``; the wall clock is read only for keys that
    have one (one more dict lookup, on a hash already computed: no timing beyond the lookup)."""
    expires_at = loaded.key_expires_at.get(digest)
    if expires_at is not None and wall() >= expires_at:
        raise key_expired(expires_at)


# The id logged for a key: the start of its sha256, as `tierproxy keys list` shows it (which
# key of a tenant's served, during a rotation's overlap); never the key, never the whole hash.
KEY_ID_CHARS = 12


def identify(
    headers: Mapping[str, str], loaded: LoadedConfig, wall: Callable[[], float] = time.time
) -> tuple[Tenant, str]:
    """The tenant whose key the request carries and the key's sha256 (the request keeps it
    while it waits: ``key_refusal`` at a reload; never the key), or 401 (a wrong key, or one
    past its ``expires_at`` by ``wall``, the POSIX clock). Its id is the hash's first
    ``KEY_ID_CHARS``."""
    key = api_key_from(headers)
    digest = hash_key(key) if key else ""
    tenant = loaded.tenant_by_key_hash.get(digest) if key else None
    if tenant is None:
        raise unauthorized()
    expires_at = loaded.key_expires_at.get(digest)  # inline: this runs for every request
    if expires_at is not None and wall() >= expires_at:
        raise key_expired(expires_at)
    return tenant, digest


def key_refusal(
    loaded: LoadedConfig, digest: str, tenant: str, wall: Callable[[], float] = time.time
) -> ProxyError | None:
    """What a new request with the key of sha256 ``digest`` would get under ``loaded``, for a
    request admitted for ``tenant`` that still waits: None while the key still maps to that
    tenant; else the very 401 (unknown key: removed, its tenant removed, or the key moved to
    another tenant; past its ``expires_at``)."""
    found = loaded.tenant_by_key_hash.get(digest) if digest else None
    if found is None or found.name != tenant:
        return unauthorized()
    expires_at = loaded.key_expires_at.get(digest)
    if expires_at is not None and wall() >= expires_at:
        return key_expired(expires_at)
    return None


def authenticate(
    headers: Mapping[str, str], loaded: LoadedConfig, wall: Callable[[], float] = time.time
) -> Tenant:
    """The tenant whose key the request carries, or 401 (see ``identify``)."""
    return identify(headers, loaded, wall)[0]


def authenticate_admin(
    headers: Mapping[str, str], loaded: LoadedConfig, wall: Callable[[], float] = time.time
) -> None:
    """Pass an admin key, or 404 when the admin API is off, or 401 (expired too)."""
    if not loaded.admin_key_hashes:
        raise admin_disabled()
    key = api_key_from(headers)
    digest = hash_key(key) if key else ""
    if not key or digest not in loaded.admin_key_hashes:
        raise unauthorized()
    _check_expiry(loaded, digest, wall)
