"""Store configuration: one TOML file plus environment overrides, frozen and validated on load.

Example ``kvstore.toml``::

    [store]
    root = "/var/lib/kvstore"
    default_ttl = "72h"
    policy = "chain"

    [[tiers]]            # fastest first
    name = "dram"
    kind = "dram"
    capacity_bytes = "8GiB"

    [[tiers]]
    name = "nvme"
    kind = "nvme"
    capacity_bytes = "500GiB"

    [[tiers]]
    name = "object"
    kind = "object"
    url = "s3://bucket/kvstore"

Environment overrides (applied after the file): ``KVSTORE_ROOT``, ``KVSTORE_DEFAULT_TTL``,
``KVSTORE_POLICY``, and ``KVSTORE_TIER_<NAME>_<OPTION>`` for any tier option, e.g.
``KVSTORE_TIER_DRAM_CAPACITY_BYTES=16GiB``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvstore.errors import ConfigError
from kvstore.events import EventsConfig, events_config
from kvstore.units import parse_duration

DEFAULT_TTL_S = 72 * 3600.0
MAX_TIERS = 8  # the index keeps tier membership in one byte
MAX_NAMESPACES = 1 << 16  # the index keeps a block's namespace in 16 bits


@dataclass(frozen=True, slots=True)
class TierSpec:
    name: str
    kind: str
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ConfigError(f"tier name {self.name!r} must be a non-empty word (letters, digits, - or _)")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))


def default_tiers() -> tuple[TierSpec, ...]:
    """Embedded defaults: no external service, everything under the store's root, and small:
    a new store directory takes tens of MB (the NVMe slab file is preallocated), enough for
    examples, demos and tests. Production sizes its tiers in the config file
    (docs/operations.md, "Sizing the tiers"; deploy/kvstore.toml)."""
    return (
        TierSpec("dram", "dram", {"capacity_bytes": "64MiB", "slab_bytes": "16MiB"}),
        TierSpec("nvme", "nvme", {"capacity_bytes": "64MiB", "slab_bytes": "16MiB"}),
        TierSpec("object", "object", {"capacity_bytes": "1GiB"}),
    )


@dataclass(frozen=True, slots=True)
class StoreConfig:
    root: Path = Path("./kvstore-data")
    """The store directory: the NVMe tier's slab file and RocksDB, the object tier's local objects,
    ``namespaces.json``, ``pins.json``, the event log. ``kvstore serve --data-dir`` overrides it."""
    tiers: tuple[TierSpec, ...] = field(default_factory=default_tiers)
    default_ttl_s: float = DEFAULT_TTL_S
    """How long a block stays after its last use when its namespace sets no TTL of its own
    (``"72h"``); every hit refreshes it."""
    policy: str = "chain"
    """Eviction policy of every tier: ``chain`` (LRU with a loop exception for long chains, never
    below LRU), ``lru``, ``density``, ``cost``, ``arc``, ``lrb``, ``lhd`` (eviction/; docs/eviction.md
    has what each does, when to choose it, and the measurements)."""
    policy_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Options of the policy's own ``Config`` (e.g. ``{ghost_factor = 4}``); see eviction/."""
    admission: str = "reuse"
    """Which demoted blocks are written into the last tier (the paid object store): ``reuse``
    (skip blocks unlikely to be read again, within a hit-loss budget of 0.75%; a refused block with
    cached children leaves with its subtree; never a pinned, durably put or recovered block),
    ``learned`` (the same, by a model fitted online on past decisions; budget 1%) or ``all``
    (eviction/admission.py; docs/eviction.md, "Admission to the last tier")."""
    admission_options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Options of the admission rule's ``Config`` (e.g. ``{hit_loss_budget = 0.005, inner = false}``;
    below, "[store] admission_options")."""
    promote_on_hit: bool = True
    """Copy a block served from a slower tier into the fastest one, so that its next hit is
    cheaper."""
    persist_on_close: bool = True
    """On a clean close, write blocks that live only in volatile tiers down to a persistent one."""
    expire_work_cap: int = 4096
    """Blocks an expiry pass may remove per call."""
    evict_work_cap: int = 8192
    """Candidates an eviction may examine per round."""
    pin_limit_fraction: float = 0.5
    """Pins with a deadline are refused once pinned blocks would fill this share of the last
    tier: the rest stays for best-effort blocks, and a guarantee given is never broken."""
    max_namespaces: int = 8192
    """Namespaces the store registers at most (every tenant's together); past it a registration
    is refused (QuotaExceededError). At most 65,536, what the index can tell apart."""
    events: EventsConfig = field(default_factory=EventsConfig)
    """``[events]``: the access and block-event log (kvstore/events.py); off in process by default."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))
        object.__setattr__(self, "tiers", tuple(self.tiers))
        object.__setattr__(self, "policy_options", MappingProxyType(dict(self.policy_options)))
        object.__setattr__(self, "admission_options", MappingProxyType(dict(self.admission_options)))
        if not self.tiers:
            raise ConfigError("the store needs at least one tier; add a [[tiers]] table")
        if len(self.tiers) > MAX_TIERS:
            raise ConfigError(f"at most {MAX_TIERS} tiers are supported, got {len(self.tiers)}")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}")
        if self.default_ttl_s <= 0:
            raise ConfigError(f"default_ttl must be positive, got {self.default_ttl_s} s")
        if self.expire_work_cap <= 0 or self.evict_work_cap <= 0:
            raise ConfigError("expire_work_cap and evict_work_cap must be positive")
        if isinstance(self.max_namespaces, bool) or not isinstance(self.max_namespaces, int) \
                or not 1 <= self.max_namespaces <= MAX_NAMESPACES:
            raise ConfigError(f"max_namespaces must be a whole number in 1..{MAX_NAMESPACES}, got {self.max_namespaces!r}")
        if not 0.0 < self.pin_limit_fraction <= 1.0:
            raise ConfigError(f"pin_limit_fraction must be in (0, 1], got {self.pin_limit_fraction}")


_STORE_KEYS = {
    "root": ("root", str),
    "default_ttl": ("default_ttl_s", None),
    "default_ttl_s": ("default_ttl_s", None),
    "policy": ("policy", str),
    "policy_options": ("policy_options", dict),
    "admission": ("admission", str),
    "admission_options": ("admission_options", dict),
    "promote_on_hit": ("promote_on_hit", bool),
    "persist_on_close": ("persist_on_close", bool),
    "expire_work_cap": ("expire_work_cap", int),
    "evict_work_cap": ("evict_work_cap", int),
    "pin_limit_fraction": ("pin_limit_fraction", float),
    "max_namespaces": ("max_namespaces", int),
}


_STORE_ENV = {"root": "KVSTORE_ROOT", "default_ttl": "KVSTORE_DEFAULT_TTL", "policy": "KVSTORE_POLICY"}
"""``[store]`` keys an environment variable overrides, and the variable."""
TIER_ENV_PREFIX = "KVSTORE_TIER_"


def _store_kwargs(
    section: Mapping[str, Any], where: str, label: Callable[[str], str] | None = None
) -> dict[str, Any]:
    """``label(key)``: how errors name a key (default ``[store].key``; an environment variable
    for an override)."""
    name_of = label or (lambda k: f"{where}.{k}")
    out: dict[str, Any] = {}
    for k, v in section.items():
        if k not in _STORE_KEYS:
            raise ConfigError(f"{where}: unknown key {k!r}; known: {', '.join(_STORE_KEYS)}")
        name, typ = _STORE_KEYS[k]
        if name == "default_ttl_s":
            out[name] = parse_duration(v, name_of(k))
        elif typ is bool and isinstance(v, str):
            if v.lower() not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"{name_of(k)}: expected true or false, got {v!r}")
            out[name] = v.lower() in ("1", "true", "yes")
        else:
            try:
                out[name] = typ(v) if typ else v
            except ValueError as e:
                raise ConfigError(f"{name_of(k)}: {e}") from e
    return out


def tier_env_prefix(name: str) -> str:
    """``KVSTORE_TIER_<NAME>_``: the prefix of the environment variables of tier ``name``."""
    return f"{TIER_ENV_PREFIX}{name.upper().replace('-', '_')}_"


def _tier_env(tiers: tuple[TierSpec, ...], env: Mapping[str, str]) -> tuple[TierSpec, ...]:
    """The tiers with ``KVSTORE_TIER_<NAME>_<OPTION>`` overrides applied and checked: a
    variable naming no tier, or an option its tier does not have, is refused (not ignored), and
    errors name the variable."""
    prefixes = sorted(((tier_env_prefix(t.name), t) for t in tiers), key=lambda p: -len(p[0]))
    by_tier: dict[str, dict[str, str]] = {t.name: {} for t in tiers}
    for var in sorted(k for k in env if k.startswith(TIER_ENV_PREFIX)):
        # The longest matching prefix: tier "nvme_fast" owns KVSTORE_TIER_NVME_FAST_*, not "nvme".
        match = next(((p, t) for p, t in prefixes if var.startswith(p) and len(var) > len(p)), None)
        if match is None:
            raise ConfigError(
                f"environment variable {var} names no tier of this configuration; known tiers: "
                f"{', '.join(t.name for t in tiers)} (write {TIER_ENV_PREFIX}<NAME>_<OPTION>, e.g. "
                f"{tier_env_prefix(tiers[0].name)}CAPACITY_BYTES)"
            )
        by_tier[match[1].name][var[len(match[0]):].lower()] = var
    out = []
    for t in tiers:
        from_env = by_tier[t.name]
        if not from_env:
            out.append(t)
            continue
        opts = {**t.options, **{k: env[var] for k, var in from_env.items()}}
        _check_tier_env(t, opts, from_env, env)
        out.append(replace(t, options=opts))
    return tuple(out)


def _check_tier_env(t: TierSpec, opts: dict[str, Any], from_env: dict[str, str], env: Mapping[str, str]) -> None:
    """Build the tier's own config now, so that a bad override is named by its variable here
    rather than found by key when the store opens."""
    from kvstore.registry import build_config, tier_class

    cls = tier_class(t.kind)
    fields = [f.name for f in dataclasses.fields(cls.Config)]
    for key, var in from_env.items():
        if key not in fields:
            raise ConfigError(
                f"environment variable {var}: tier {t.name!r} ({t.kind}) has no option {key!r}; "
                f"known: {', '.join(fields)}"
            )
    try:
        build_config(cls.Config, opts, f"tier {t.name!r}")
    except ConfigError as e:
        msg = str(e)
        for key, var in from_env.items():
            msg = msg.replace(f"tier {t.name!r}.{key}:", f"environment variable {var}:")
        if msg == str(e):  # a check across options: name every variable that took part
            msg += " (with " + ", ".join(f"{v}={env[v]!r}" for v in from_env.values()) + " from the environment)"
        raise ConfigError(msg) from None


def read_toml(path: str | os.PathLike[str] | None) -> dict[str, Any]:
    """The tables of a config file (None: none); ConfigError says what is wrong with it."""
    if path is None:
        return {}
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist; pass an existing TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from e


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> StoreConfig:
    """Load ``path`` (TOML; None: defaults), apply ``KVSTORE_*`` environment overrides, validate."""
    env = os.environ if env is None else env
    data = read_toml(path)
    # [server] and [[tenants]] belong to the daemon (kvstore/server/config.py), same file.
    unknown = set(data) - {"store", "tiers", "server", "tenants", "events"}
    if unknown:
        raise ConfigError(
            f"config: unknown table(s) {', '.join(sorted(unknown))}; "
            "use [store], [[tiers]], [events], [server] and [[tenants]]"
        )
    kwargs = _store_kwargs(data.get("store", {}), "[store]")
    tiers = default_tiers()
    if "tiers" in data:
        specs = []
        for i, t in enumerate(data["tiers"]):
            t = dict(t)
            try:
                name = t.pop("name", t.get("kind"))
                kind = t.pop("kind")
            except KeyError:
                raise ConfigError(f"[[tiers]] #{i + 1} needs kind = 'dram' | 'nvme' | 'object'") from None
            specs.append(TierSpec(str(name), str(kind), t))
        tiers = tuple(specs)
    for key, var in _STORE_ENV.items():
        if var in env:
            kwargs.update(_store_kwargs({key: env[var]}, "environment", label=lambda _k, v=var: f"environment variable {v}"))  # type: ignore[misc]  # mypy cannot infer a lambda with a default
    if "KVSTORE_POLICY" in env:
        from kvstore.registry import POLICIES

        if env["KVSTORE_POLICY"] not in POLICIES:
            raise ConfigError(
                f"KVSTORE_POLICY={env['KVSTORE_POLICY']!r}: unknown eviction policy; known: {', '.join(POLICIES)}"
            )
    kwargs["tiers"] = _tier_env(tiers, env)
    for var in sorted(k for k in env if k.startswith("KVSTORE_EVENTS_")):
        try:
            events_config({}, {var: env[var]})
        except ConfigError as e:
            raise ConfigError(f"environment variable {var}={env[var]!r}: {e}") from None
    kwargs["events"] = events_config(data.get("events", {}), env)
    kwargs.update(overrides)
    return StoreConfig(**kwargs)
