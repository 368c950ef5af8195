"""Every response of the control plane matches the daemon's own OpenAPI schema (issue 33, low).

A schema-driven fuzz found 32 places where a response differed from what ``/openapi.json``
declares (error bodies and statuses the schema did not list, above all). This test sends every
route a set of requests (valid, unauthenticated, wrongly authenticated, malformed, naming an
unknown namespace), and checks each answer's status is declared for that operation and its
JSON body validates against the declared schema.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
from jsonschema import Draft202012Validator

from kvstore.client import connect
from kvstore.server.config import Limits, TenantSpec
from kvstore.server.daemon import ThreadedDaemon
from tests.conftest import SMALL_NS, chain_for

TOKEN_A = "token-of-openapi-tenant-a-01"
TOKEN_OPS = "token-of-openapi-admin-0123"
NS = bytes(SMALL_NS.root).hex()
HASHES = [h.hex() for h in chain_for(1, 2)]
UNKNOWN = "ab" * 16

BODIES: dict[str, list[Any]] = {
    "/v1/lookup": [{"ns": NS, "hashes": HASHES}, {"ns": NS, "tokens": [1, 2, 3]}, {"ns": UNKNOWN, "hashes": HASHES},
                   {"ns": NS, "tokens": [True, False]}, {"ns": NS}, {"ns": "zz"}],
    "/v1/namespaces": [{"namespace": SMALL_NS.to_dict()}, {"namespace": {"model_id": 3}}, {}],
    "/v1/pin": [{"ns": NS, "hashes": HASHES}, {"ns": NS, "hashes": HASHES, "until": 1.0}, {"ns": UNKNOWN, "hashes": HASHES}],
    "/v1/unpin": [{"ns": NS, "hashes": HASHES}, {"ns": "x", "hashes": []}],
    "/v1/evict": [{"ns": NS, "hashes": HASHES}, {"ns": UNKNOWN, "hashes": HASHES}],
    "/v1/handoffs": [{"ns": NS, "hashes": HASHES, "request_id": "r1", "ttl_s": 10},
                     {"ns": NS, "hashes": HASHES, "request_id": "r2", "ttl_s": -1}],
}
AUTHS: list[dict[str, str]] = [
    {"Authorization": f"Bearer {TOKEN_A}"}, {"Authorization": f"Bearer {TOKEN_OPS}"}, {},
    {"Authorization": "Bearer wrong-token-0000000000"}, {"Authorization": "Basic abc"},
]


def _validator(spec: dict[str, Any], schema: dict[str, Any]) -> Draft202012Validator:
    return Draft202012Validator({**schema, "components": spec.get("components", {})})


def _declared(op: dict[str, Any], status: int) -> dict[str, Any] | None:
    responses = op.get("responses", {})
    r = responses.get(str(status)) or responses.get(f"{status // 100}XX") or responses.get("default")
    return r


def test_every_response_matches_the_daemons_openapi_schema(
    start_daemon: Callable[..., ThreadedDaemon], figures: Callable[..., None]
) -> None:
    tenants = (TenantSpec("a", TOKEN_A, allow_shm=True), TenantSpec("ops", TOKEN_OPS, admin=True))
    d = start_daemon(tenants, limits=Limits(max_body_bytes=64 * 1024, max_blocks=256, max_payload_bytes=64 * 4096))
    with connect(d.url, token=TOKEN_A, plane="tcp") as c:
        c.register_namespace(SMALL_NS)
    spec = httpx.get(f"{d.url}/openapi.json", timeout=30).json()
    mismatches: list[str] = []
    statuses: Counter[int] = Counter()
    checked = 0
    with httpx.Client(base_url=d.url, timeout=30) as h:
        for path, methods in spec["paths"].items():
            for method, op in methods.items():
                concrete = path.replace("{request_id}", "r1").replace("{key}", HASHES[0]).replace("{tenant}", "a")
                bodies = BODIES.get(path, [None]) if method in ("post", "put") else [None]
                for body in bodies:
                    for auth in AUTHS:
                        r = h.request(method.upper(), concrete, json=body, headers=auth)
                        statuses[r.status_code] += 1
                        checked += 1
                        where = f"{method.upper()} {path} -> {r.status_code}"
                        declared = _declared(op, r.status_code)
                        if declared is None:
                            mismatches.append(f"{where}: status not declared")
                            continue
                        schema = declared.get("content", {}).get("application/json", {}).get("schema")
                        if schema is None or not r.headers.get("content-type", "").startswith("application/json"):
                            continue
                        errors = list(_validator(spec, schema).iter_errors(r.json()))
                        if errors:
                            mismatches.append(f"{where}: {errors[0].message}")
    assert not mismatches, f"{len(mismatches)} responses differ from the schema:\n" + "\n".join(sorted(set(mismatches)))
    figures(requests=checked, statuses=dict(sorted(statuses.items())), mismatches=0)
