"""docs/config.md is what the config dataclasses generate, and names every KVSTORE_* variable."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from tools.configdoc.__main__ import OUT, main, render

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("kvstore", "tiers", "eviction", "engine", "tools")


def test_config_md_is_generated_from_the_code() -> None:
    # A process of its own: tests register extra tiers and policies in this one's registries.
    out = subprocess.run([sys.executable, "-m", "tools.configdoc", "--check"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, f"docs/config.md is stale: run `python -m tools.configdoc` ({out.stderr})"


def test_check_fails_on_drift(tmp_path: Path) -> None:
    stale = tmp_path / "config.md"
    stale.write_text(render().replace("pin_limit_fraction", "pin_limit", 1))
    assert main(["--check", "-o", str(stale)]) == 1


def test_every_environment_variable_is_documented() -> None:
    page = OUT.read_text()
    names: set[str] = set()
    for pkg in SOURCES:
        for f in (ROOT / pkg).rglob("*.py"):
            names |= set(re.findall(r"KVSTORE_[A-Z0-9_]*[A-Z0-9]", f.read_text()))
    # Prefixes the code completes (KVSTORE_TIER_<NAME>_..., KVSTORE_EVENTS_<KEY>) and examples.
    documented = {n for n in names if n in page or any(p.startswith(n + "_") or p.startswith(n + "<")
                                                       for p in re.findall(r"KVSTORE_[A-Z0-9_<>]+", page))}
    if "KVSTORE_TIER_<NAME>_<OPTION>" in page:  # any tier's option, by the tier's name
        documented |= {n for n in names if n.startswith("KVSTORE_TIER_")}
    assert names - documented == set()
    assert len(names) >= 10


def test_every_key_outside_the_policies_says_what_it_does() -> None:
    """[store], the tiers, [events], [server] and [[tenants]]: no empty "what" cell (the
    eviction policies' and admission rules' options are described in docs/eviction.md)."""
    page = render()
    head = page[:page.index("## `[store] policy_options`")]
    empty = re.findall(r"(?m)^\| `(\w+)` \|[^\n]*\|  \|$", head)
    assert empty == []
