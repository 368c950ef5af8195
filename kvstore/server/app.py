"""The control plane: FastAPI on uvicorn. Small JSON requests only; payloads use the data plane.

Every store call runs in the daemon's thread pool (the store blocks on disk and on its lock), so
the event loop never waits for I/O. Hashes travel as 32-character hex strings; namespace ids are
the client's namespace root digest in hex (``Namespace.root.hex()``).
"""


import json
import time
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvstore.errors import KVStoreError, UsageError, error_kind
from kvstore.keys import Namespace
from kvstore.server import requestlog
from kvstore.server.admin import admin_router
from kvstore.server.dataplane import DataContext
from kvstore.server.docs import install_docs
from kvstore.server.handoff import handoff_router
from kvstore.server.metrics import CONTENT_TYPE
from kvstore.server.service import AuthError, ForbiddenError, Tenant, classify

HEX16 = r"^[0-9a-fA-F]{32}$"
DAEMON_HEADER = (b"x-kvstore-daemon", b"1")
"""On every reply: how a client tells a kvstore daemon from whatever else answers on a port."""
INLINE_LOOKUP_BODY = 64 * 1024
"""A lookup body up to this size (~1,800 hashes) is parsed and answered on the event loop (from
memory, when the store is not busy); a larger one, up to 65,536 hashes or max_tokens token ids,
is parsed, checked against its limits and answered in the pool, so it never delays /healthz or
another tenant's lookup."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class NamespaceIn(_Body):
    namespace: dict[str, Any] = Field(description="kvstore.keys.Namespace.to_dict() without tenant_salt")
    ttl_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class BlocksIn(_Body):
    ns: str = Field(pattern=HEX16, description="namespace id: the client's Namespace.root in hex")
    hashes: list[Annotated[str, Field(pattern=HEX16)]]


class PinIn(BlocksIn):
    until: float | None = Field(
        default=None, gt=0, allow_inf_nan=False,
        description="wall-clock deadline (unix seconds): a retention guarantee until then, refused "
        "with 409 when the store cannot honour it; omit it for a pin that holds until unpinned",
    )


class LookupIn(_Body):
    ns: str = Field(pattern=HEX16)
    hashes: list[Annotated[str, Field(pattern=HEX16)]] | None = None
    # strict: JSON true/false are not token ids (pydantic's lax mode reads them as 1 and 0)
    tokens: list[Annotated[int, Field(ge=-(2**31), lt=2**31, strict=True)]] | None = None


class ErrorOut(BaseModel):
    """Every error body (docs/daemon.md, "Errors")."""

    detail: str | list[dict[str, Any]] = Field(
        description="what went wrong and what to do; for a malformed body (422), where and what")
    kind: str = Field(description="the kvstore.errors class a client raises (a 409 alone does not say which)")


_ERROR_STATUSES = {
    400: "a request the store refuses (UsageError)",
    401: "no bearer token, or an unknown one",
    403: "the tenant may not do this (not an admin, no shared memory)",
    404: "an unknown namespace, block or handoff",
    409: "a missing prefix, a layout mismatch or a guarantee the store cannot give",
    413: "a body over max_body",
    422: "a malformed body",
    503: "a tier the request needs is unavailable",
    507: "over the tenant's quota, or a tier is full",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorOut, "description": why} for code, why in _ERROR_STATUSES.items()
}
"""Declared on every operation, so that /openapi.json lists the error bodies the daemon sends."""


class LookupOut(BaseModel):
    num_blocks: int = Field(description="leading blocks cached (the usable prefix)")
    num_tokens: int
    tiers: list[str] = Field(description="the tier holding each cached block")
    unavailable: list[str] = Field(description="tiers that cannot be reached now (blocks only there are not counted)")


B = TypeVar("B", bound=BaseModel)


def _parse(model: type[B], raw: bytes) -> B:
    """``raw`` JSON validated into ``model``; errors as FastAPI reports a bad body (422)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise RequestValidationError(
            [{**err, "loc": ("body", *err["loc"])} for err in e.errors(include_url=False, include_input=False)]
        ) from None


class _BodyLimit:
    """Refuses bodies over the limit with 413 before reading them whole (ASGI middleware)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        for k, v in scope.get("headers", []):
            if k == b"content-length" and v.isdigit() and int(v) > self.limit:
                return await self._too_large(send)
        seen = 0
        too_big = False

        async def limited() -> Any:
            nonlocal seen, too_big
            msg = await receive()
            if msg["type"] == "http.request" and not too_big:
                seen += len(msg.get("body", b""))
                if seen > self.limit:  # a chunked body without Content-Length: cut it short
                    too_big = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def guarded(msg: Any) -> None:
            if not too_big:
                await send(msg)

        await self.app(scope, limited, guarded)
        if too_big:
            await self._too_large(send)

    async def _too_large(self, send: Any) -> None:
        resp = JSONResponse(
            {"detail": f"request body exceeds {self.limit} bytes; send fewer hashes per request",
             "kind": "UsageError"},
            status_code=413,
        )
        await send({"type": "http.response.start", "status": 413, "headers": resp.raw_headers})
        await send({"type": "http.response.body", "body": resp.body})


class _Timing:
    """``kvstore_request_seconds{plane="http", op=<route>}`` per request (plain ASGI middleware:
    Starlette's ``BaseHTTPMiddleware`` runs each request in a task behind memory streams, which
    cost more than the lookup itself)."""

    def __init__(self, app: Any, metrics: Any) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]], send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(msg: Any) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", ()), DAEMON_HEADER]}
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:  # the router put the matched route into the scope
            op = getattr(scope.get("route"), "path", "unmatched")
            spent = time.perf_counter() - t0
            self.metrics.observe("http", op, spent, str(status))
            if requestlog.enabled():
                requestlog.record(scope, op, status, spent)


def _hashes(items: list[str], limit: int) -> list[bytes]:
    if len(items) > limit:
        raise UsageError(f"{len(items)} hashes exceed the limit of {limit} per request; split it")
    return [bytes.fromhex(h) for h in items]


def _check_leaves(node: Any, where: str) -> None:
    """A descriptor arrives as any JSON, but every field of a namespace is a string or an
    integer: a dict where a model id belongs would be registered, persisted and then break
    every view of the namespaces."""
    if isinstance(node, dict) and (where in ("namespace", "namespace.layout") or where.endswith("]")):
        for k, v in node.items():  # the descriptor, its layout, a layer group
            _check_leaves(v, f"{where}.{k}")
    elif isinstance(node, list | tuple) and where.endswith(".groups"):  # the one list
        for i, v in enumerate(node):
            _check_leaves(v, f"{where}[{i}]")
    elif isinstance(node, bool) or not isinstance(node, str | int):
        raise UsageError(f"{where} must be a string or an integer, got {node!r}; send Namespace.to_dict()")


def make_app(ctx: DataContext, info: dict[str, Any], ready: Callable[[], bool]) -> Any:
    """``info``: the data-plane endpoints (ports) a client needs; ``ready``: readiness probe."""
    svc, metrics = ctx.service, ctx.metrics
    limits = svc.limits
    app = FastAPI(
        title="kvstore daemon",
        version="1",
        docs_url=None,  # served from a packaged copy: kvstore/server/docs.py
        redoc_url=None,
        description="Control plane of the kvstore daemon. Block payloads move on the data plane "
        "(shared memory, framed TCP, UCX), never through this API.",
        responses=ERROR_RESPONSES,
    )

    # Error bodies: {"detail": the message, "kind": the kvstore.errors class name}; a client
    # raises the class ``kind`` names (a 409 is a missing prefix, a layout mismatch or a refused
    # guarantee: the status alone does not say which). docs/daemon.md, "Errors".
    @app.exception_handler(KVStoreError)
    async def _store_error(request: Request, exc: KVStoreError) -> JSONResponse:
        _, status = classify(exc)
        return JSONResponse({"detail": str(exc), "kind": error_kind(exc)}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's own handler echoes the offending input, which cannot always be rendered
        # back as JSON (NaN, Infinity): a 500 for a bad request. Where and what, not the input.
        detail = [{"loc": list(e.get("loc", ())), "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
                  for e in exc.errors()]
        return JSONResponse({"detail": detail, "kind": "UsageError"}, status_code=422)

    app.add_middleware(_Timing, metrics=metrics)
    install_docs(app)

    async def tenant(authorization: Annotated[str | None, Header()] = None) -> Tenant:
        token = None
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token:
                raise AuthError("the Authorization header must be 'Bearer <token>'")
        return svc.authenticate(token)

    def admin(t: Annotated[Tenant, Depends(tenant)]) -> Tenant:
        if not t.spec.admin:
            raise ForbiddenError(f"tenant {t.name!r} is not an admin; this endpoint shows every tenant's data")
        return t

    Auth = Annotated[Tenant, Depends(tenant)]
    Admin = Annotated[Tenant, Depends(admin)]

    @app.post(
        "/v1/lookup",
        response_model=LookupOut,
        openapi_extra={
            "parameters": [{"name": "authorization", "in": "header", "required": False, "schema": {"type": "string"}}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": LookupIn.model_json_schema()}}},
        },
    )
    async def lookup(request: Request) -> Response:
        """Cached prefix length and the tier of each cached block, by hashes or token ids."""
        # The hot path of every engine request, so the first route the router tries. The body
        # is parsed and validated here (one pydantic call) and the answer sent pre-serialised,
        # which skips FastAPI's dependency and response machinery (docs/benchmarks.md, rpc).
        t = await tenant(request.headers.get("authorization"))
        raw = await request.body()
        if len(raw) > INLINE_LOOKUP_BODY:
            return await ctx.run(_lookup_blocking, t, raw)
        body = _parse(LookupIn, raw)
        ns_id, hashes = _lookup_request(body)
        if hashes is None:
            return await ctx.run(_lookup_blocking, t, raw, body)
        # An in-memory answer on the event loop saves two thread hops; when the store is busy
        # (or a shared tier may need a probe) the lookup goes to the pool as before.
        r = svc.lookup_nowait(t, ns_id, hashes) or await ctx.run(svc.lookup, t, ns_id, hashes)
        return _lookup_reply(r)

    def _lookup_request(body: LookupIn) -> tuple[bytes, list[bytes] | None]:
        """The namespace id and the hashes (None: a token lookup), limits checked first."""
        if (body.hashes is None) == (body.tokens is None):
            raise UsageError("send exactly one of 'hashes' or 'tokens'")
        if body.tokens is not None and len(body.tokens) > limits.max_tokens:
            raise UsageError(f"{len(body.tokens)} tokens exceed the limit of {limits.max_tokens}")
        return bytes.fromhex(body.ns), None if body.hashes is None else _hashes(body.hashes, limits.max_blocks)

    def _lookup_blocking(t: Tenant, raw: bytes, body: LookupIn | None = None) -> Response:
        """A large lookup, whole, on a worker thread."""
        if body is None:
            body = _parse(LookupIn, raw)
        ns_id, hashes = _lookup_request(body)
        r = svc.lookup_tokens(t, ns_id, body.tokens) if hashes is None else svc.lookup(t, ns_id, hashes)
        return _lookup_reply(r)

    def _lookup_reply(r: Any) -> Response:
        out = {"num_blocks": r.num_blocks, "num_tokens": r.num_tokens, "tiers": list(r.tiers),
               "unavailable": list(r.unavailable)}
        return Response(json.dumps(out, separators=(",", ":")).encode(), media_type="application/json")

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"])
    async def readyz() -> JSONResponse:
        """Readiness: the store is open and the data plane listens."""
        ok = ready()
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["health"])
    async def prometheus(t: Admin) -> Response:
        body = await ctx.run(metrics.render)
        return Response(body, media_type=CONTENT_TYPE)

    @app.get("/v1/info")
    async def get_info(t: Auth) -> dict[str, Any]:
        """Where the data plane listens and what this tenant may use."""
        return {**info, "tenant": t.name, "node_id": ctx.node_id,
                "arena": svc.arena if t.spec.allow_shm else None,
                "max_blocks": limits.max_blocks, "max_payload_bytes": limits.max_payload_bytes}

    @app.post("/v1/namespaces")
    async def register(body: NamespaceIn, t: Auth) -> dict[str, Any]:
        try:
            ns = Namespace.from_dict(body.namespace)
        except UsageError:
            raise
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise UsageError(f"not a namespace descriptor ({e}); send Namespace.to_dict()") from e
        _check_leaves(ns.to_dict(), "namespace")
        """Register a namespace. ``layout_conflicts``: this tenant's registered namespaces of
        the same model deployment with another layout (block size, dtype, ...), each with the
        differing fields; both stay usable, but their blocks never hit each other."""
        ns_id, conflicts = await ctx.run(svc.register, t, ns, body.ttl_s)
        return {"ns": ns_id.hex(), "block_bytes": ns.block_bytes, "block_tokens": ns.block_tokens,
                "layout_conflicts": conflicts}

    @app.get("/v1/namespaces")
    async def namespaces(t: Auth) -> list[dict[str, Any]]:
        items = await ctx.run(svc.list_namespaces, t)
        return [{"ns": k.hex(), "model_id": ns.model_id, "block_bytes": ns.block_bytes} for k, ns in items]

    def _blocks_endpoint(path: str, fn: Callable[..., int], doc: str) -> None:
        async def handler(body: BlocksIn, t: Auth) -> dict[str, int]:
            n = await ctx.run(lambda: fn(t, bytes.fromhex(body.ns), _hashes(body.hashes, limits.max_blocks)))
            return {"blocks": n}

        handler.__doc__ = doc
        app.post(path, name=path.rsplit("/", 1)[-1])(handler)

    @app.post("/v1/pin", name="pin")
    async def pin(body: PinIn, t: Auth) -> dict[str, Any]:
        """Protect the cached prefix from expiry and eviction: until unpinned, or with ``until``
        guaranteed until then (409 when the store cannot honour it; nothing is pinned then)."""
        n = await ctx.run(lambda: svc.pin(t, bytes.fromhex(body.ns), _hashes(body.hashes, limits.max_blocks), body.until))
        return {"blocks": n} if body.until is None else {"blocks": n, "until": body.until}

    @app.get("/v1/pins")
    async def pins(t: Auth, ns: Annotated[str | None, Query(pattern=HEX16)] = None) -> dict[str, Any]:
        """This tenant's pins (or those of its namespace ``ns``), never another tenant's: each
        with its namespace, length, deadline (``until``; null: until unpinned) and whether it
        still holds; a summary; and the bytes its guarantees hold against its ``pin_quota``."""
        return await ctx.run(svc.list_pins, t, None if ns is None else bytes.fromhex(ns))

    _blocks_endpoint("/v1/unpin", svc.unpin, "Undo one pin of the longest pinned prefix of these hashes "
                     "(a pin with a deadline only whole), else take them out of an untimed pin.")
    _blocks_endpoint("/v1/evict", svc.evict, "Delete these blocks and every cached block that extends them.")

    @app.get("/v1/stats")
    async def stats(t: Auth) -> dict[str, Any]:
        """The tenant's usage; for an admin also the whole store's statistics."""
        out: dict[str, Any] = {"usage": svc.usage(t)}
        if t.spec.admin:
            out["store"] = await ctx.run(svc.store.stats)
            out["tenants"] = [svc.usage(x) for x in svc.tenants()]
        return out

    @app.post("/v1/maintain")
    async def maintain(t: Admin) -> dict[str, int]:
        """Run expiry and persist refreshed expiry times now (the daemon also runs it periodically)."""
        out = await ctx.run(svc.store.maintain)
        await ctx.run(svc.refresh_usage)
        return out

    app.include_router(admin_router(ctx, admin))  # /v1/admin: kvctl's endpoints (admin.py)
    app.include_router(handoff_router(svc, ctx.run, tenant))  # /v1/handoffs, /v1/events (handoff.py)
    return _BodyLimit(app, limits.max_body_bytes)
