"""Write (or ``--check``) docs/config.md from the config dataclasses themselves.

Every table of the TOML file, every key with its default and the field's own docstring, every
tier kind's and policy's options (from the registries), and every ``KVSTORE_*`` environment
variable. ``tests/tools/test_configdoc.py`` fails when the page and the code drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvstore import config as store_config
from kvstore import events
from kvstore.registry import ADMISSIONS, POLICIES, TIERS, admission_class, policy_class, tier_class
from kvstore.server import config as server_config
from kvstore.version import version

ROOT = Path(__file__).resolve().parents[2]
# kvstore/server/config.py builds these names as f"KVSTORE_SERVER_{key.upper()}" (its docstring
# lists them too; the drift test checks every KVSTORE_ name in the sources is on the page).
SERVER_ENV_KEYS = ("host", "http_port", "data_port", "ucx_port", "ucx")
TENANT_KEYS = ("name", "token", "token_env", "quota", "pin_quota", "admin", "allow_shm")
OUT = ROOT / "docs" / "config.md"


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of a dataclass (the string after ``x: int = 1``)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body  # type: ignore[attr-defined]
        for a, b in zip(body, body[1:], strict=False):
            if (isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                out[a.target.id] = " ".join(inspect.cleandoc(b.value.value).split())
    return out


def _size(n: int) -> str:
    for unit, k in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f'"{n >> k}{unit}"'
    return str(n)


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        v = f.default
    elif f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
    else:
        return "(required)"
    if isinstance(v, bool) or v is None:
        return {True: "true", False: "false", None: "(unset)"}[v]
    if isinstance(v, int) and f.name.endswith("_bytes"):
        return _size(v)
    if isinstance(v, int | float) and f.name.endswith("_s"):
        return f"{v:g} s"
    if isinstance(v, Mapping):
        return "{}" if not v else str(dict(v))
    if isinstance(v, tuple | list):
        return "[]" if not v else f"{len(v)} entries"
    return f'"{v}"' if isinstance(v, str | Path) else repr(v)


def _doc(cls: type) -> str:
    return inspect.cleandoc(cls.__doc__ or "") if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else ""


def table(cls: type, keys: Mapping[str, str] | None = None, skip: Iterable[str] = ()) -> list[str]:
    """A Markdown table of ``cls``'s fields; ``keys``: TOML key -> field name where they differ."""
    docs = field_docs(cls)
    by_field = {v: k for k, v in (keys or {}).items()}
    rows = ["| key | default | type | what |", "|---|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        key = by_field.get(f.name, f.name)
        typ = str(f.type).replace("|", "\\|")
        rows.append(f"| `{key}` | `{_default(f)}` | `{typ}` | {docs.get(f.name, '')} |")
    return rows


def _keys(mapping: Mapping[str, tuple[str, Any]]) -> dict[str, str]:
    """TOML key -> field name, the first (documented) spelling of each field."""
    out: dict[str, str] = {}
    for k, (name, _) in mapping.items():
        if name not in out.values():
            out[k] = name
    return out


def env_vars() -> list[tuple[str, str]]:
    """Every environment variable kvstore reads, with what it sets."""
    rows = [(var, f"`[store] {key}`") for key, var in store_config._STORE_ENV.items()]
    rows.append((f"{store_config.TIER_ENV_PREFIX}<NAME>_<OPTION>",
                 "option `<option>` of the tier named `<name>` (e.g. `KVSTORE_TIER_DRAM_CAPACITY_BYTES=16GiB`); "
                 "a variable that names no tier, or an option its tier lacks, is refused"))
    rows += [(f"KVSTORE_EVENTS_{k.upper()}", f"`[events] {k}`") for k in events._KEYS]
    rows += [(f"KVSTORE_SERVER_{k.upper()}", f"`[server] {k}`") for k in SERVER_ENV_KEYS]
    rows += [
        ("KVSTORE_URL", "the daemon a client (`kvstore.client.connect`, `kvctl`) talks to; default http://127.0.0.1:7070"),
        ("KVSTORE_TOKEN", "the bearer token a client sends (`connect`, `kvctl`)"),
        ("KVSTORE_BENCH_VLLM_THREADS", "compute threads of every engine `python -m tools.bench vllm` runs (default 1)"),
        ("KVSTORE_BENCH_FAMILIES", "`python -m tools.bench vllm --workload families`: only these rows (comma-separated names; default all)"),
        ("the variable a tenant's `token_env` names", "that tenant's token, read by the daemon (e.g. `KVSTORE_TOKEN_TEAM_A`, `KVSTORE_TOKEN_OPS`)"),
    ]
    return rows


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated by `python -m tools.configdoc` from the config dataclasses; do not edit by hand "
        "(`tests/tools/test_configdoc.py` fails when this page and the code differ). One TOML file "
        "(`kvstore serve --config FILE`, `load_config(FILE)`) holds every table; environment "
        "variables override it (last section). Sizes take units (`\"64MiB\"`, `\"1.5GB\"`), durations "
        "too (`\"72h\"`, `\"30min\"`). Sizing production tiers: `docs/operations.md`.",
        "",
        "## `[store]`",
        "",
        *table(store_config.StoreConfig, _keys(store_config._STORE_KEYS), skip=("tiers", "events")),
        "",
        "## `[[tiers]]`",
        "",
        "Fastest first; each table has `name` (default: its kind), `kind` and the kind's options. "
        "Without `[[tiers]]` the store uses the embedded defaults:",
        "",
        "| name | kind | options |",
        "|---|---|---|",
        *[f"| `{t.name}` | `{t.kind}` | {', '.join(f'`{k} = {v!r}`' for k, v in t.options.items())} |"
          for t in store_config.default_tiers()],
        "",
    ]
    for kind in TIERS:
        cls = tier_class(kind).Config
        out += [f"### kind = `\"{kind}\"` (`{TIERS[kind]}`)", ""]
        if _doc(cls):
            out += [_doc(cls), ""]
        out += [*table(cls), ""]
    out += ["## `[events]`", "", _doc(events.EventsConfig), "",
            *table(events.EventsConfig, _keys(events._KEYS)), ""]
    out += ["## `[server]` (the daemon)", "",
            *table(server_config.ServerConfig, _keys(server_config._SERVER_KEYS), skip=("tenants", "limits")), "",
            "Request limits, also in `[server]`:", "", _doc(server_config.Limits), "",
            *table(server_config.Limits, _keys(server_config._LIMIT_KEYS)), ""]
    out += ["## `[[tenants]]`", "", _doc(server_config.TenantSpec), "",
            "Keys: " + ", ".join(f"`{k}`" for k in TENANT_KEYS) + " (`token` or `token_env`).", ""]
    out += ["## `[store] policy_options`", "", "Options of the eviction policy `[store] policy` names.", ""]
    for name in POLICIES:
        cls = policy_class(name).Config
        out += [f"### policy = `\"{name}\"` (`{POLICIES[name]}`)", "", *table(cls), ""]
    out += ["## `[store] admission_options`", "", "Options of the admission rule `[store] admission` names.", ""]
    for name in ADMISSIONS:
        cls = admission_class(name).Config
        out += [f"### admission = `\"{name}\"` (`{ADMISSIONS[name]}`)", "", *(table(cls) if dataclasses.fields(cls) else ["No options."]), ""]
    out += ["## Environment variables", "", "| variable | sets |", "|---|---|",
            *[f"| `{v}` | {what} |" for v, what in env_vars()], ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.configdoc", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/config.md is not what the code generates")
    p.add_argument("-o", "--output", type=Path, default=OUT)
    p.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not args.output.exists() or args.output.read_text() != text:
            print(f"{args.output} is out of date: run `python -m tools.configdoc`", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
