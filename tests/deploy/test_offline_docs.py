"""/docs works air-gapped: Swagger UI's page and assets come from the daemon itself."""

from __future__ import annotations

import re
from collections.abc import Callable

import httpx

from kvstore.server.daemon import ThreadedDaemon
from tests.kvstore.conftest import start_daemon  # noqa: F401  (the fixture)


def test_docs_load_no_asset_from_outside(start_daemon: Callable[..., ThreadedDaemon]) -> None:  # noqa: F811
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
        assert "SwaggerUIBundle" in http.get("/docs/static/swagger-ui-bundle.js").text
        assert http.get("/redoc").status_code == 404  # ReDoc only exists on a CDN
