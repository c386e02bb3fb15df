"""Loading the YAML that ops edit: validation with field paths and line numbers, keys resolved
from the environment, tenants validated in chunks that hand the GIL back to the event loop."""

from __future__ import annotations

import ipaddress
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    TypeAdapter,
    ValidationError,
)

from proxy.config.base import Misplaced
from proxy.config.config_file import read_config_bytes
from proxy.config.deprecated import flat_policy_warnings
from proxy.config.schema import Config, LoadedConfig
from proxy.config.tenants import KeySpec, Tenant, hash_key
from proxy.config.yaml_load import Lines, safe_load, yield_gil

log = logging.getLogger("tierproxy")

# The example keys shipped in configs/tierproxy.env.example (and the secret's placeholder, in
# case it is pasted as a key): a deployment that kept them would let anyone in as that tenant.
# Refused at start and on reload, by value (env keys) and by hash (sha256 keys).
PLACEHOLDER_KEYS = ("change-me", "change-me-too", "change-me-to-a-long-random-string")
PLACEHOLDER_KEY_PREFIX = "change-me"
PLACEHOLDER_KEY_HASHES = frozenset(hash_key(key) for key in PLACEHOLDER_KEYS)
_PLACEHOLDER_PROBLEM = (
    "an example placeholder (configs/tierproxy.env.example): generate a key, e.g."
    " python -c 'import secrets; print(secrets.token_urlsafe(32))'"
)


class ConfigError(Exception):
    """Every problem found in one config file, each naming its field and line."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


Environ = Mapping[str, str]


def _digest_of(spec: KeySpec, environ: Environ) -> tuple[str | None, str | None]:
    """(sha256 of the key, None) or (None, the problem); a placeholder key is a problem, as the
    placeholder ticket secret is (``proxy.ticket.check_secret``)."""
    if spec.env is not None:
        raw = environ.get(spec.env)
        if not raw:
            return None, f"environment variable {spec.env} is not set"
        if raw.strip().lower().startswith(PLACEHOLDER_KEY_PREFIX):
            return None, f"environment variable {spec.env} holds {_PLACEHOLDER_PROBLEM}"
        digest: str | None = hash_key(raw)
    else:
        digest = spec.sha256
    if digest in PLACEHOLDER_KEY_HASHES:
        return None, f"the key is {_PLACEHOLDER_PROBLEM}"
    return digest, None


def _resolve_keys(
    config: Config, lines: Lines, environ: Environ, expires: dict[str, float]
) -> tuple[dict[str, Tenant], frozenset[str], list[str], list[str]]:
    """(tenant by key hash, admin key hashes, problems, warnings)."""
    by_hash: dict[str, Tenant] = {}
    problems: list[str] = []
    warnings: list[str] = []

    def where(loc: tuple[int | str, ...]) -> str:
        return f"{'.'.join(str(p) for p in loc)} (line {lines.of(loc)})"

    for t_index, tenant in enumerate(config.tenants):
        for k_index, spec in enumerate(tenant.keys):
            loc = ("tenants", t_index, "keys", k_index)
            digest, problem = _digest_of(spec, environ)
            if digest is None:
                problems.append(f"{where(loc)}: {problem}")
                continue
            owner = by_hash.get(digest)
            if owner is not None and owner.name != tenant.name:
                problems.append(f"{where(loc)}: key already belongs to tenant {owner.name!r}")
                continue
            if owner is not None:
                warnings.append(
                    f"{where(loc)}: tenant {tenant.name!r} lists this key twice: it expires at"
                    " the earliest expires_at of its listings, and `tierproxy keys revoke` of"
                    " one listing leaves the other working"
                )
            by_hash[digest] = tenant
            _note_expiry(expires, digest, spec)
    admin: set[str] = set()
    for index, spec in enumerate(config.admin_keys):
        digest, problem = _digest_of(spec, environ)
        if digest is None:
            problems.append(f"{where(('admin_keys', index))}: {problem}")
        elif digest in by_hash:
            problems.append(
                f"{where(('admin_keys', index))}: an admin key must not also be a tenant's key"
            )
        else:
            admin.add(digest)
            _note_expiry(expires, digest, spec)
    return by_hash, frozenset(admin), problems, warnings


def _note_expiry(expires: dict[str, float], digest: str, spec: KeySpec) -> None:
    """One key listed twice (for one tenant) expires at the earliest time any listing gives it,
    whatever their order: an expiry someone wrote (a rotation's) is never undone by another
    listing without one (``inf``: never)."""
    at = float("inf") if spec.expires_at is None else spec.expires_at.timestamp()
    expires[digest] = min(expires.get(digest, float("inf")), at)


def _missing_env_keys(data: dict[str, Any], lines: Lines, environ: Environ) -> list[str]:
    problems = []
    tenants = data.get("tenants")
    for t_index, tenant in enumerate(tenants if isinstance(tenants, list) else []):
        keys = tenant.get("keys") if isinstance(tenant, dict) else None
        for k_index, spec in enumerate(keys if isinstance(keys, list) else []):
            env = spec.get("env") if isinstance(spec, dict) else None
            if isinstance(env, str) and not environ.get(env):
                line = lines.of(("tenants", t_index, "keys", k_index))
                problems.append(
                    f"tenants.{t_index}.keys.{k_index} (line {line}):"
                    f" environment variable {env} is not set"
                )
    return problems


# Tenants validated per call. One pydantic call holds the GIL throughout, so a reload parsed in
# a worker thread would stall the event loop for all 10,000 tenants at once (~80 ms) otherwise.
_TENANT_CHUNK = 100
_TENANTS = TypeAdapter(list[Tenant])
_Errors = list[tuple[tuple[int | str, ...], str]]


def _where(err: Any) -> tuple[int | str, ...]:
    """An error's place: pydantic's, else the one a cross-check gave (``Misplaced``)."""
    cause = (err.get("ctx") or {}).get("error")
    return tuple(err["loc"]) or (cause.loc if isinstance(cause, Misplaced) else ())


def _validate(data: dict[str, Any]) -> tuple[Config | None, _Errors]:
    """The config, or None and every error (location, message)."""
    raw = data.get("tenants")
    errors: _Errors = []
    if isinstance(raw, list) and len(raw) > _TENANT_CHUNK:
        tenants: list[Tenant] = []
        for start in range(0, len(raw), _TENANT_CHUNK):
            try:
                tenants += _TENANTS.validate_python(raw[start : start + _TENANT_CHUNK])
                yield_gil()  # see proxy.config.yaml_load.YIELD_EVERY
            except ValidationError as exc:
                for err in exc.errors():
                    index, *rest = err["loc"]
                    errors.append((("tenants", start + int(index), *rest), err["msg"]))
        # Validated instances are taken as they are: what is left is the rest and cross-checks.
        data = {**data, "tenants": [] if errors else tenants}
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        return None, errors + [(_where(err), err["msg"]) for err in exc.errors()]
    return (None, errors) if errors else (config, errors)


def parse_config(
    text: str, source: str = "<config>", environ: Environ | None = None
) -> LoadedConfig:
    """Validate YAML text; raises ConfigError listing every problem with its line. ``environ``:
    where env keys are read (the process's environment by default)."""
    env = os.environ if environ is None else environ
    try:
        data: Any = safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError(source, ["the file must be a mapping with tiers, tenants and backends"])
    lines = Lines(text)
    config, errors = _validate(data)
    if config is None:
        problems = []
        for loc, msg in errors:
            path = ".".join(str(p) for p in loc) or "(top level)"
            problems.append(f"{path} (line {lines.of(loc)}): {msg}")
        # Report missing key variables too, so one `tierproxy check` shows everything.
        problems += _missing_env_keys(data, lines, env)
        raise ConfigError(source, problems)
    expires: dict[str, float] = {}
    by_hash, admin, problems, warnings = _resolve_keys(config, lines, env, expires)
    if problems:
        raise ConfigError(source, problems)
    deprecated = flat_policy_warnings(data)
    for warning in deprecated:
        log.warning("%s: %s", source, warning)
    return LoadedConfig(
        config=config,
        tenant_by_key_hash=by_hash,
        admin_key_hashes=admin,
        source=source,
        key_expires_at={digest: at for digest, at in expires.items() if at != float("inf")},
        warnings=tuple(warnings + deprecated),
    )


def load_config(path: str | Path) -> LoadedConfig:
    p = Path(path)
    try:
        text = read_config_bytes(p).decode("utf-8")
    except OSError as exc:
        raise ConfigError(str(p), [f"cannot read: {exc.strerror}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), [f"not UTF-8: {exc}"]) from exc
    return parse_config(text, source=str(p))


def summarize(loaded: LoadedConfig) -> str:
    cfg = loaded.config
    lines = [f"{loaded.source}: ok"]
    lines.append(f"  listen {cfg.listen.host}:{cfg.listen.port}")
    for name, tier in sorted(cfg.tiers.items(), key=lambda kv: kv[1].priority):
        tenants = [t.name for t in cfg.tenants if t.tier == name]
        lines.append(
            f"  tier {name}: priority {tier.priority}, weight {tier.weight:g},"
            f" queue {tier.max_queue}, wait {tier.queue_timeout_s:g}s,"
            f" run {tier.request_timeout_s:g}s, prefill share {cfg.prefill_share(name):g},"
            f" tenants {len(tenants)}"
        )
    lines.append(f"  tenants {len(cfg.tenants)}, keys {len(loaded.tenant_by_key_hash)}")
    for b in cfg.backends:
        ceiling = b.max_inflight or cfg.adaptive_room.max_room
        room = f"adaptive up to {ceiling}" if b.adaptive_room else f"fixed {b.max_inflight}"
        lines.append(f"  backend {b.label}: room {room}")
    lines += [f"  warning: {w}" for w in [*loaded.warnings, *metrics_warnings(loaded)]]
    return "\n".join(lines)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def metrics_warnings(loaded: LoadedConfig) -> list[str]:
    """Where /metrics (every tenant's name and usage) would be readable without a key, or not
    served at all (`tierproxy check` prints these)."""
    cfg = loaded.config
    admin = cfg.admin_listen
    if admin is not None:
        if _loopback(admin.host):
            return []
        return [
            f"/metrics on admin_listen {admin.host}:{admin.port} needs no key and lists every"
            " tenant's usage: keep that address private (firewall, internal network) or bind it"
            " to 127.0.0.1"
        ]
    if not loaded.admin_key_hashes:
        return [
            "no admin_listen and no admin_keys: /metrics is not served (404); set admin_listen,"
            " or admin_keys and scrape the client listener with one as a bearer token"
        ]
    return []
