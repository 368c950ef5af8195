"""Swagger UI at ``/docs`` from a packaged copy, not a CDN, so the API reference works on an
air-gapped node. The copy is Swagger UI 5 (the ``fastapi-offline`` wheel ships its static
files; only those are used), which reads the OpenAPI 3.1 that FastAPI writes: Swagger UI 4
(the ``swagger-ui-bundle`` wheel) answers "Unable to render this definition" to it. ReDoc
(CDN only) is off."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

STATIC = "/docs/static"
INSTALL_HINT = "pip install 'kvstore-llm[server]'"


def swagger_ui_dir() -> Path | None:
    """The directory of Swagger UI 5's ``swagger-ui-bundle.js`` and ``swagger-ui.css``, or None
    when ``fastapi-offline`` is not installed. Found without importing the package (its module
    only wraps FastAPI, which the daemon does itself)."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / "static"
    return static if (static / "swagger-ui-bundle.js").is_file() else None


def install_docs(app: FastAPI) -> None:
    """``/docs`` and its assets under ``/docs/static`` (the app is made with ``docs_url=None``)."""
    static = swagger_ui_dir()
    if static is None:
        @app.get("/docs", include_in_schema=False)
        async def no_docs() -> HTMLResponse:
            return HTMLResponse(
                f"<p>Swagger UI is not installed: <code>{INSTALL_HINT}</code> (it brings "
                "fastapi-offline, whose wheel carries Swagger UI). The API description: "
                f"<a href='{app.openapi_url}'>{app.openapi_url}</a>.</p>", status_code=404)
        return

    from starlette.staticfiles import StaticFiles

    app.mount(STATIC, StaticFiles(directory=str(static)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Any:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title}: API",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon.png",
            # No badge fetched from validator.swagger.io: nothing leaves the node.
            swagger_ui_parameters={"validatorUrl": None},
        )
