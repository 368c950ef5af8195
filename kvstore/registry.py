"""Registries of tiers and eviction policies: ``name -> "module:Class"``, imported lazily.

New tiers and policies are added here (or with :func:`register_tier` / :func:`register_policy`),
never with ``if kind == ...`` chains. A missing optional dependency is reported with the extra
that installs it.
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

from kvstore.clock import Clock, system_clock
from kvstore.errors import ConfigError
from kvstore.units import parse_duration, parse_size

TIERS: dict[str, str] = {
    "hbm": "tiers.hbm:HbmTier",
    "dram": "tiers.dram:DramTier",
    "nvme": "tiers.nvme:NvmeTier",
    "object": "tiers.object:ObjectTier",
    "null": "tiers.null:NullTier",  # metadata only: trace replay (tools/replay)
}
POLICIES: dict[str, str] = {
    "lru": "eviction.lru:LRUPolicy",
    "arc": "eviction.arc:ARCPolicy",
    "density": "eviction.density:DensityPolicy",
    "cost": "eviction.costaware:CostAwarePolicy",
    "lrb": "eviction.lrb:LRBPolicy",
    "chain": "eviction.chain:ChainPolicy",
    "lhd": "eviction.lhd:LHDPolicy",
}
ADMISSIONS: dict[str, str] = {
    "all": "eviction.admission:Admission",  # write every demoted block
    "reuse": "eviction.admission:ReuseAdmission",  # skip blocks unlikely to be read again
    "learned": "eviction.admission:LearnedAdmission",  # the same, by a model learned online
}
_INSTALL_HINTS = {
    "s3fs": "pip install 'kvstore-llm[s3]'",
    "torch": "pip install torch (see README: CI pins torch==2.13.0)",
    "ucxx": "pip install 'kvstore-llm[ucx]'",
    "lmdb": "pip install 'kvstore-llm[lmdb]'",
}


def register_tier(kind: str, target: str) -> None:
    TIERS[kind] = target


def register_policy(name: str, target: str) -> None:
    POLICIES[name] = target


def _load(table: dict[str, str], name: str, what: str) -> Any:
    try:
        target = table[name]
    except KeyError:
        raise ConfigError(f"unknown {what} {name!r}; known: {', '.join(sorted(table))}") from None
    module, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        hint = _INSTALL_HINTS.get((e.name or "").split(".")[0])
        if hint:
            raise ConfigError(f"{what} {name!r} needs {e.name}: {hint}") from e
        raise


def register_admission(name: str, target: str) -> None:
    ADMISSIONS[name] = target


def admission_class(name: str) -> Any:
    return _load(ADMISSIONS, name, "admission rule")


def make_admission(name: str, options: dict[str, Any], view: Any, hits: Any) -> Any:
    """The admission rule of the slow tiers, ``Class(Class.Config(**options))``, bound to the
    index view and to ``hits`` (a callable: the store's hit blocks so far)."""
    cls = admission_class(name)
    adm = cls(build_config(cls.Config, options, f"admission {name!r}"))
    adm.bind(view, hits)
    return adm


def tier_class(kind: str) -> Any:
    return _load(TIERS, kind, "tier kind")


def policy_class(name: str) -> Any:
    return _load(POLICIES, name, "eviction policy")


def make_policies(name: str, options: dict[str, Any], view: Any, tiers: list[Any]) -> list[Any]:
    """One policy per tier, ``Class(Class.Config(**options))``, each bound to the index view
    and told which tier it orders (its kind, and the kind of the tier below it)."""
    from eviction.base import TierContext  # the policies' own leaf module

    cls = policy_class(name)
    config = build_config(cls.Config, options, f"policy {name!r}")
    out = []
    for k, t in enumerate(tiers):
        pol = cls(config)
        nxt = tiers[k + 1].kind if k + 1 < len(tiers) else ""
        pol.bind(view, TierContext(t.name, t.kind, k, nxt))
        out.append(pol)
    return out


def build_config(cls: type, options: dict[str, Any], what: str) -> Any:
    """Instantiate the frozen config dataclass ``cls`` from loose TOML options.

    Fields named ``*_bytes`` accept sizes ("4GiB"), fields named ``*_s`` durations ("72h").
    """
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(options) - set(fields)
    if unknown:
        raise ConfigError(
            f"{what}: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(fields)}"
        )
    kwargs: dict[str, Any] = {}
    for k, v in options.items():
        if k.endswith("_bytes"):
            v = parse_size(v, f"{what}.{k}")
        elif k.endswith("_s"):
            v = parse_duration(v, f"{what}.{k}")
        elif isinstance(v, str):  # environment overrides arrive as strings
            v = _coerce(v, fields[k].type, f"{what}.{k}")
        kwargs[k] = v
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ConfigError(f"{what}: {e}") from e


def _coerce(value: str, annotation: Any, what: str) -> Any:
    kind = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    if kind == "bool":
        if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
            raise ConfigError(f"{what}: expected true or false, got {value!r}")
        return value.lower() in ("1", "true", "yes")
    if kind in ("int", "float"):
        try:
            return int(value) if kind == "int" else float(value)
        except ValueError:
            raise ConfigError(f"{what}: expected a number, got {value!r}") from None
    return value


def make_tier(
    kind: str, name: str, options: dict[str, Any], root: Path, clock: Clock = system_clock
) -> Any:
    """Build a tier: ``Class(name, Class.Config(**options), root=root, clock=clock)``."""
    cls = tier_class(kind)
    config = build_config(cls.Config, options, f"tier {name!r}")
    return cls(name, config, root=root, clock=clock)
