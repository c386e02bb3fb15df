"""`tierproxy keys`: add, rotate, revoke and list a tenant's API keys in the config file.

A new key is ``tp-`` and 32 random bytes (``secrets``), shown once; the file keeps its sha256,
its id (the sha256's first 12 hex digits) and when it was made. A running proxy applies the
file by its own reload (it watches the file; SIGHUP applies it at once): nothing to call.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from proxy.config.schema import Config
from proxy.config.tenants import KEY_ID_DIGITS, KeySpec, hash_key, utc_time
from proxy.tools.keyedit import KeyEditError, KeysList
from proxy.tools.keyfile import ConfigEdit, KeyFileError

KEY_PREFIX = "tp-"
Now = Callable[[], datetime]
_SPAN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class KeysError(Exception):
    """Why a `tierproxy keys` command changed nothing."""


def utc_now() -> datetime:
    return datetime.now(UTC)


def parse_span(text: str) -> timedelta:
    """``90d``, ``24h``, ``30m``, ``45s``, ``2w``."""
    match = _SPAN.match(text)
    if match is None:
        raise KeysError(f"{text!r}: give a span like 90d, 24h, 30m or 2w")
    try:
        return timedelta(seconds=float(match[1]) * _UNIT_S[match[2]])
    except OverflowError:
        raise KeysError(f"{text!r}: too long a span") from None


def later(at: datetime, span: timedelta, text: str) -> datetime:
    """``at`` + ``span`` (written ``text``), or KeysError past the year 9999."""
    try:
        return at + span
    except OverflowError:
        raise KeysError(f"{text!r}: that ends after the year 9999") from None


def parse_expiry(text: str, now: datetime) -> datetime:
    """A span from now (``90d``) or a time (``2026-06-30``, ``2026-06-30T12:00:00Z``)."""
    if _SPAN.match(text):
        return later(now, parse_span(text), text)
    try:
        value = utc_time(text.strip())
    except ValueError as exc:  # out of range once in UTC
        raise KeysError(str(exc)) from None
    if not isinstance(value, datetime):
        raise KeysError(f"{text!r}: give a span like 90d or an ISO 8601 date or time")
    return value


def _whole_second_up(at: datetime) -> datetime:
    return at.replace(microsecond=0) + timedelta(seconds=1 if at.microsecond else 0)


def _whole_seconds(spec: KeySpec) -> dict[str, datetime | None]:
    """The times as written (``stamp``): whole seconds."""
    return {
        "created_at": spec.created_at.replace(microsecond=0) if spec.created_at else None,
        "expires_at": spec.expires_at.replace(microsecond=0) if spec.expires_at else None,
    }


def stamp(at: datetime) -> str:
    """The YAML text of a time: ISO 8601, UTC, whole seconds."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class NewKey:
    key: str  # shown once
    key_id: str
    expires_at: datetime | None


def _tenant_keys(config: Config, tenant: str) -> tuple[int, list[KeySpec]]:
    for index, t in enumerate(config.tenants):
        if t.name == tenant:
            return index, list(t.keys)
    raise KeysError(f"no tenant {tenant!r} in the config")


def _find(keys: list[KeySpec], tenant: str, key_id: str) -> int:
    matches = [i for i, spec in enumerate(keys) if spec.key_id == key_id]
    if len(matches) != 1:
        ids = ", ".join(spec.key_id for spec in keys)
        raise KeysError(f"tenant {tenant!r} has no key {key_id!r} (its keys: {ids})")
    return matches[0]


def _new_key(config: Config) -> tuple[str, str]:
    taken = {spec.key_id for t in config.tenants for spec in t.keys}
    while True:
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(key)
        if digest[:KEY_ID_DIGITS] not in taken:
            return key, digest


def _edit(
    path: str | Path, tenant: str, change: Callable[[ConfigEdit, KeysList, Config], str]
) -> list[str]:
    """Run ``change`` (it returns the new text, and has set ``expected``) under the lock;
    the notes for the operator (env keys not checkable here)."""
    try:
        with ConfigEdit(path) as edit:
            assert edit.loaded is not None
            config = edit.loaded.config
            change(edit, KeysList(edit.text, tenant), config)
            return [
                f"note: {name} is not set here; the key it holds was not checked"
                for name in edit.unset_env
            ]
    except (KeyEditError, KeyFileError) as exc:
        raise KeysError(str(exc)) from exc


def _expected(config: Config, t_index: int, keys: list[KeySpec]) -> dict[str, Any]:
    expected = config.model_dump()
    expected["tenants"][t_index]["keys"] = [spec.model_dump() for spec in keys]
    return expected


def _make_key(
    config: Config, expires: str | None, at: datetime
) -> tuple[str, KeySpec, list[tuple[str, str]]]:
    """A new key, its spec and the fields written for it."""
    expires_at = parse_expiry(expires, at) if expires else None
    if expires_at is not None and expires_at <= at:
        raise KeysError(f"--expires {expires}: that time has passed")
    key, digest = _new_key(config)
    spec = KeySpec(sha256=digest, id=digest[:KEY_ID_DIGITS], created_at=at, expires_at=expires_at)
    # Quoted: hex digits that happen to be all decimal would read as a YAML number.
    fields = [("sha256", f'"{digest}"'), ("id", f'"{spec.id}"'), ("created_at", stamp(at))]
    if expires_at is not None:
        fields.append(("expires_at", stamp(expires_at)))
    return key, spec.model_copy(update=_whole_seconds(spec)), fields


def add_key(
    path: str | Path, tenant: str, expires: str | None = None, now: Now = utc_now
) -> tuple[NewKey, list[str]]:
    """A new key for ``tenant`` (expiring at ``expires``: a span or a time), written to the
    file; the key itself is only in the answer."""
    result: list[NewKey] = []

    def change(edit: ConfigEdit, keys_list: KeysList, config: Config) -> str:
        t_index, keys = _tenant_keys(config, tenant)
        key, spec, fields = _make_key(config, expires, now())
        text = keys_list.append(fields)
        edit.commit(text, _expected(config, t_index, [*keys, spec]))
        result.append(NewKey(key, spec.key_id, spec.expires_at))
        return text

    notes = _edit(path, tenant, change)
    return result[0], notes


def _to_retire(keys: list[KeySpec], tenant: str, old_id: str | None, ends: datetime) -> int:
    if old_id is not None:
        return _find(keys, tenant, old_id)
    live = [i for i, s in enumerate(keys) if s.expires_at is None or s.expires_at > ends]
    if len(live) != 1:
        ids = ", ".join(keys[i].key_id for i in live) or "none"
        raise KeysError(
            f"tenant {tenant!r} has {len(live)} keys that outlive the overlap ({ids}):"
            " name the one to retire with --keep ID"
        )
    return live[0]


def rotate_key(
    path: str | Path,
    tenant: str,
    old_id: str | None = None,
    overlap: str = "24h",
    expires: str | None = None,
    now: Now = utc_now,
) -> tuple[NewKey, str, datetime, list[str]]:
    """One edit: a new key, and the old one (``old_id``, else the tenant's only key that
    outlives the overlap) given ``expires_at`` = now + ``overlap`` (kept where it is sooner):
    clients move to the new key within the overlap, without an outage."""
    result: list[tuple[NewKey, str, datetime]] = []
    span = parse_span(overlap)

    def change(edit: ConfigEdit, keys_list: KeysList, config: Config) -> str:
        t_index, keys = _tenant_keys(config, tenant)
        at = now()
        ends = _whole_second_up(later(at, span, overlap))  # the old key works the overlap
        index = _to_retire(keys, tenant, old_id, ends)
        key, spec, fields = _make_key(config, expires, at)
        text = keys_list.append(fields)
        old = keys[index]
        until = old.expires_at
        if until is None or until > ends:
            until = ends
            text = KeysList(text, tenant).set_field(index, "expires_at", stamp(ends))
            keys[index] = old.model_copy(update={"expires_at": ends})
        edit.commit(text, _expected(config, t_index, [*keys, spec]))
        result.append((NewKey(key, spec.key_id, spec.expires_at), old.key_id, until))
        return text

    notes = _edit(path, tenant, change)
    return (*result[0], notes)


def revoke_key(path: str | Path, tenant: str, key_id: str) -> list[str]:
    """Remove the key from the file (a tenant keeps at least one key: the loader says so)."""

    def change(edit: ConfigEdit, keys_list: KeysList, config: Config) -> str:
        t_index, keys = _tenant_keys(config, tenant)
        index = _find(keys, tenant, key_id)
        text = keys_list.remove(index)
        edit.commit(text, _expected(config, t_index, keys[:index] + keys[index + 1 :]))
        return text

    return _edit(path, tenant, change)


def key_rows(config: Config, tenant: str | None, now: datetime) -> list[tuple[str, ...]]:
    """(tenant, id, created, expires, state) of each key: never the key, nor its full hash."""
    if tenant is not None:
        _tenant_keys(config, tenant)
    rows: list[tuple[str, ...]] = []
    for t in config.tenants:
        if tenant is not None and t.name != tenant:
            continue
        for spec in t.keys:
            state = "active"
            if spec.expires_at is not None:
                state = "expired" if spec.expires_at <= now else f"expires in {_left(spec, now)}"
            created = stamp(spec.created_at) if spec.created_at else "-"
            expires = stamp(spec.expires_at) if spec.expires_at else "never"
            rows.append((t.name, spec.key_id, created, expires, state))
    return rows


def _left(spec: KeySpec, now: datetime) -> str:
    assert spec.expires_at is not None
    seconds = (spec.expires_at - now).total_seconds()
    return f"{seconds / 86400:.1f}d" if seconds >= 86400 else f"{seconds / 3600:.1f}h"


def expiry_warnings(config: Config, now: datetime, within_days: float) -> list[str]:
    """`tierproxy check`: keys that expired, or expire within ``within_days``."""
    try:
        soon = now + timedelta(days=within_days)
    except OverflowError:  # --expiring-days 1e9: every key with a time
        soon = datetime.max.replace(tzinfo=UTC)
    out = []
    for t in config.tenants:
        for spec in t.keys:
            at = spec.expires_at
            if at is None or at > soon:
                continue
            if at <= now:
                out.append(f"key {spec.key_id} of tenant {t.name!r} expired at {stamp(at)}")
            else:
                out.append(
                    f"key {spec.key_id} of tenant {t.name!r} expires at {stamp(at)}"
                    f" (in {_left(spec, now)}): `tierproxy keys rotate {t.name}`"
                )
    return out
