"""``docs/results/`` holds the raw output that the docs' current tables cite, and nothing else:
every file there is named by a doc, a test or a tool, and every ``docs/results/...`` path that
they name exists. Names may use shell braces (``run-{1,2}.jsonl`` is two files)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
NAME = re.compile(r"[\w.{},-]+\.(?:jsonl|log|txt)")
CITED_PATH = re.compile(r"docs/results/([\w.{},-]+)")


def expand(token: str) -> list[str]:
    """Shell brace expansion of ``token`` (``a{1,2}b`` → ``a1b``, ``a2b``)."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [
        e
        for part in m.group(1).split(",")
        for e in expand(token[: m.start()] + part + token[m.end() :])
    ]


def sources(root: Path) -> list[Path]:
    out = [*sorted((root / "docs").glob("*.md")), root / "README.md"]
    for where in ("tests", "tools"):
        out += sorted(p for p in (root / where).rglob("*") if p.suffix in {".py", ".sh", ".md"})
    return [p for p in out if p.is_file()]


def cited_names(texts: list[str]) -> set[str]:
    return {e.rsplit("/", 1)[-1] for t in texts for token in NAME.findall(t) for e in expand(token)}


def cited_paths(texts: list[str]) -> set[str]:
    return {
        e.rstrip(".,;:") for t in texts for token in CITED_PATH.findall(t) for e in expand(token)
    }


def test_every_results_file_is_cited() -> None:
    names = cited_names([p.read_text() for p in sources(ROOT)])
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in names)
    assert uncited == [], "cited by no doc, test or tool: delete them (git keeps them)"


def test_every_cited_results_file_exists() -> None:
    paths = cited_paths([p.read_text() for p in sources(ROOT) if p != Path(__file__)])
    missing = sorted(p for p in paths if not (RESULTS / p).is_file())
    assert missing == []


def test_braces_expand_to_every_name() -> None:
    text = "see `docs/results/peers-d{1,2}-r{1,2}.jsonl` and `x.log`."
    assert cited_paths([text]) == {f"peers-d{d}-r{r}.jsonl" for d in (1, 2) for r in (1, 2)}
    assert cited_names([text]) == {f"peers-d{d}-r{r}.jsonl" for d in (1, 2) for r in (1, 2)} | {
        "x.log"
    }
