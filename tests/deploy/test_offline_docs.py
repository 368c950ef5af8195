"""/docs works air-gapped: Swagger UI's page and assets come from the daemon itself, and the
page renders the daemon's OpenAPI 3.1 (checked in headless Chromium, with every host name but
loopback's unresolvable)."""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from kvstore.server.daemon import ThreadedDaemon
from kvstore.server.docs import swagger_ui_dir
from tests.kvstore.conftest import start_daemon  # noqa: F401  (the fixture)


def _needs_swagger_ui() -> None:
    if swagger_ui_dir() is None:
        pytest.fail("fastapi-offline (Swagger UI 5) is missing: pip install -e '.[server]'")


def test_docs_load_no_asset_from_outside(start_daemon: Callable[..., ThreadedDaemon]) -> None:  # noqa: F811
    _needs_swagger_ui()
    d = start_daemon()
    with httpx.Client(base_url=d.url, timeout=30) as http:
        page = http.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r"""(?:src|href)=['"]([^'"]+)['"]|url:\s*['"]([^'"]+)['"]""", page.text)
        urls = [a or b for a, b in assets]
        assert urls and all(u.startswith("/") for u in urls), urls  # nothing from a CDN
        for u in urls:
            r = http.get(u)
            assert r.status_code == 200 and r.content, u
        bundle = http.get("/docs/static/swagger-ui-bundle.js").text
        major = re.search(r'PACKAGE_VERSION:"(\d+)\.', bundle)
        assert major and int(major.group(1)) >= 5, "Swagger UI 4 cannot read OpenAPI 3.1"
        assert http.get("/openapi.json").json()["openapi"].startswith("3.1")
        assert http.get("/redoc").status_code == 404  # ReDoc only exists on a CDN


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_docs_page_lists_the_daemons_operations_in_chromium(
        start_daemon: Callable[..., ThreadedDaemon], tmp_path: Path) -> None:  # noqa: F811
    _needs_swagger_ui()
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: .ci/run installs it (apt-get install chromium)")
        pytest.skip("chromium is not installed: apt-get install chromium (CI installs it)")
    d = start_daemon()
    with httpx.Client(base_url=d.url, timeout=30) as http:
        spec = http.get("/openapi.json").json()
    operations = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert len(operations) >= 10
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run",
             # air-gapped: any host but loopback fails to resolve
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             f"--user-data-dir={tmp_path / 'profile'}"]
    dom = subprocess.run([browser, *flags, "--virtual-time-budget=15000", "--dump-dom", f"{d.url}/docs"],
                         capture_output=True, text=True, timeout=180, check=True).stdout
    assert "Unable to render this definition" not in dom
    # Swagger UI draws one summary per operation: its method and its path.
    drawn = {(m.upper(), html.unescape(p).replace("\u200b", "")) for m, p in re.findall(
        r'opblock-summary-method">(\w+)</span>.*?data-path="([^"]+)"', dom, flags=re.S)}
    assert drawn == operations, (operations - drawn, dom[-2000:])
