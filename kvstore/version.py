"""The package's version, for every command's ``--version``."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def version() -> str:
    """The version of this checkout (its ``pyproject.toml``), else of the installed package."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        m = re.search(r'(?m)^version\s*=\s*"([^"]+)"', pyproject.read_text())
        if m:
            return m.group(1)
    except OSError:
        pass
    try:
        return metadata.version("kvstore-llm")
    except metadata.PackageNotFoundError:
        return "unknown"
