"""deploy/: the systemd unit passes ``systemd-analyze verify`` (where systemd is installed), the
example config loads, and the Dockerfile copies what exists and starts a command the package
installs. Docker itself is not run here (no daemon in CI); the image is checked statically."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.server.config import load_server_config

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _unit_values(key: str) -> list[str]:
    return re.findall(rf"(?m)^{key}=(.*)$", (DEPLOY / "kvstore.service").read_text())


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    # verify insists that ExecStart exists; the unit names where the install steps put it.
    unit = (DEPLOY / "kvstore.service").read_text().replace("/opt/kvstore/bin/kvstore", "/bin/true")
    (tmp_path / "kvstore.service").write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", str(tmp_path / "kvstore.service")],
                         capture_output=True, text=True, timeout=60, check=False)
    # A bad value is only a warning (exit 0), so nothing at all may be printed.
    assert out.returncode == 0 and not out.stderr.strip() and not out.stdout.strip(), out.stderr


def test_systemd_unit_runs_the_daemon_on_the_example_config() -> None:
    (start,) = _unit_values("ExecStart")
    argv = shlex.split(start)
    assert argv[0].endswith("/kvstore") and argv[1] == "serve"
    assert argv[argv.index("--config") + 1] == "/etc/kvstore/kvstore.toml"
    assert argv[argv.index("--data-dir") + 1] == "/var/lib/kvstore" and _unit_values("StateDirectory") == ["kvstore"]
    from kvstore.server.cli import main

    with pytest.raises(SystemExit) as e:  # every flag it passes is one `kvstore serve` takes
        main([*argv[1:], "--help"])
    assert e.value.code == 0
    assert _unit_values("KillSignal") == ["SIGTERM"]


def test_example_config_loads() -> None:
    cfg = load_config(DEPLOY / "kvstore.toml", env={})
    assert [t.kind for t in cfg.tiers] == ["dram", "nvme"] and cfg.events.enabled
    assert load_server_config(DEPLOY / "kvstore.toml", env={}).host == "127.0.0.1"


def test_dockerfile_copies_what_exists_and_runs_an_installed_command() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    for line in re.findall(r"(?m)^COPY (.*)$", text):
        *srcs, _dst = line.split()
        for src in srcs:
            assert (ROOT / src).exists(), f"Dockerfile copies {src}, which is not in the repository"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (extras,) = re.findall(r"pip install --no-cache-dir '\.\[([a-z0-9,]+)\]'", text)
    assert set(extras.split(",")) <= set(pyproject["project"]["optional-dependencies"])
    entry = re.search(r'(?m)^ENTRYPOINT \["([^"]+)"', text)
    assert entry and entry.group(1) in pyproject["project"]["scripts"]
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {line.split()[0] for line in re.findall(r"(?m)^COPY (\w+) ", text)}
    assert packages <= copied, f"the image lacks packages {packages - copied}"


def test_every_install_line_names_this_distribution() -> None:
    """PyPI's ``kvstore`` is an unrelated project: every ``pip install`` in the README, docs/,
    deploy/ and the code's hints installs ``kvstore-llm`` (this pyproject's name) or a checkout."""
    name = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["name"]
    assert name == "kvstore-llm"
    files = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *DEPLOY.iterdir(),
             *(p for d in ("kvstore", "tiers", "engine", "tools") for p in (ROOT / d).rglob("*.py"))]
    seen = 0
    for f in files:
        for m in re.finditer(r"pip install (?:-[\w-]+ )*'([^'\[]+)\[", f.read_text()):
            assert m.group(1) != "kvstore", f"{f.relative_to(ROOT)} installs {m.group(0)!r}"
            seen += m.group(1) in (name, ".")
    assert seen >= 5


@pytest.mark.slow
def test_the_checkout_builds_the_distribution_the_docs_install(tmp_path: Path) -> None:
    """`pip install '.[server]'` in a checkout (README, docs/operations.md, the unit, the
    Dockerfile): the wheel it builds is kvstore-llm, with the server extra (Swagger UI 5's
    fastapi-offline among it) and the commands the docs name."""
    import email
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                          "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = tmp_path.glob("kvstore_llm-*.whl")
    with zipfile.ZipFile(wheel) as z:
        meta_name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(meta_name))
        entry = z.read(meta_name.replace("METADATA", "entry_points.txt")).decode()
        tops = {n.split("/")[0] for n in z.namelist() if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"kvstore", "engine", "tiers", "eviction"}, tops  # no tools/ (benchmarks, replay, lab)
    assert meta["Name"] == "kvstore-llm"
    requires = meta.get_all("Requires-Dist") or []
    assert any(r.startswith("fastapi-offline") and 'extra == "server"' in r for r in requires), requires
    for command in ("kvstore", "kvctl", "kvreport", "kvstore-demo"):
        assert re.search(rf"(?m)^{command} = ", entry), entry
