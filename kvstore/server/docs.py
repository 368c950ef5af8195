"""Swagger UI at ``/docs`` from a packaged copy (the ``swagger-ui-bundle`` wheel), not a CDN,
so the API reference works on an air-gapped node. ReDoc (CDN only) is off."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

STATIC = "/docs/static"


def install_docs(app: FastAPI) -> None:
    """``/docs`` and its assets under ``/docs/static`` (the app is made with ``docs_url=None``)."""
    try:
        from swagger_ui_bundle import swagger_ui_path
    except ImportError:
        swagger_ui_path = None

    if swagger_ui_path is None:
        @app.get("/docs", include_in_schema=False)
        async def no_docs() -> HTMLResponse:
            return HTMLResponse(
                "<p>Swagger UI is not installed: <code>pip install 'kvstore-llm[server]'</code> (it "
                f"brings swagger-ui-bundle). The API description: <a href='{app.openapi_url}'>"
                f"{app.openapi_url}</a>.</p>", status_code=404)
        return

    from starlette.staticfiles import StaticFiles

    app.mount(STATIC, StaticFiles(directory=str(swagger_ui_path)), name="swagger-ui")

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Any:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title=f"{app.title}: API",
            swagger_js_url=f"{STATIC}/swagger-ui-bundle.js",
            swagger_css_url=f"{STATIC}/swagger-ui.css",
            swagger_favicon_url=f"{STATIC}/favicon-32x32.png",
        )
