"""S3 specifics of the object tier (AWS S3, Ceph RGW, MinIO, any S3-compatible service).

* :func:`storage_options`: s3fs options from the tier config. Empty config values fall back to
  what botocore reads itself: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` /
  ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``,
  ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_CA_BUNDLE``, instance roles.
* :func:`configure`: retry and timeout settings that keep an outage short (see below).
* :func:`transport_errors`: the exceptions that mean "the endpoint did not answer".
* :func:`list_prefix`, :func:`delete_keys`: one LIST page per 1,000 keys (resumable with
  StartAfter) and one DELETE per 1,000 keys, straight to the S3 API (no directory emulation, no
  listings cache: other nodes write to the same bucket).
* :func:`lifecycle_rule`, :func:`apply_lifecycle`: an optional bucket lifecycle rule as a
  backstop behind the tier's own sweeper.

Imported only when a tier's URL is ``s3://``: s3fs is an optional extra (``kvstore-llm[s3]``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tiers.object import ObjectConfig

SCHEMES = ("s3", "s3a")


def storage_options(config: ObjectConfig) -> dict[str, Any]:
    """s3fs keyword arguments for ``config``; ``config.storage_options`` is applied last and wins
    (``config_kwargs`` and ``client_kwargs`` are merged key by key)."""
    retries = {"total_max_attempts": config.max_attempts, "mode": "standard"}
    opts: dict[str, Any] = {
        # fsspec shares one instance (one connection pool) between tiers with equal options.
        "use_listings_cache": False,
        "max_concurrency": config.max_concurrency,
        "config_kwargs": {
            "connect_timeout": config.connect_timeout_s,
            "read_timeout": config.read_timeout_s,
            "retries": retries,
            "max_pool_connections": max(10, config.max_concurrency),
        },
        "client_kwargs": {},
    }
    if config.endpoint_url:
        opts["endpoint_url"] = config.endpoint_url
    if config.region:
        # Only when asked: a region of us-east-1 sent to a non-AWS endpoint makes bucket
        # creation fail with InvalidLocationConstraint on some servers.
        opts["client_kwargs"]["region_name"] = config.region
    if config.access_key_id:
        opts["key"] = config.access_key_id
        opts["secret"] = config.secret_access_key
        if config.session_token:
            opts["token"] = config.session_token
    if config.profile:
        opts["profile"] = config.profile
    for k, v in config.storage_options.items():
        if k in ("config_kwargs", "client_kwargs") and isinstance(v, dict):
            opts[k] = {**opts[k], **v}
        else:
            opts[k] = v
    return opts


def configure(fs: Any) -> None:
    """s3fs retries transport errors itself, 5 times with sleeps of up to 15 s, on top of
    botocore's retries. One layer is enough: botocore's (``max_attempts``), so a dead endpoint
    costs at most ``max_attempts x connect_timeout`` before the breaker counts a failure."""
    fs.retries = 1


def transport_errors() -> tuple[type[BaseException], ...]:
    """botocore's connection/timeout errors (not ClientError: that is an answer) and aiohttp's."""
    out: list[type[BaseException]] = []
    try:
        from botocore.exceptions import (
            ConnectionError as BotoConnectionError,
        )
        from botocore.exceptions import (
            HTTPClientError,
            ReadTimeoutError,
        )

        out += [BotoConnectionError, HTTPClientError, ReadTimeoutError]
    except ImportError:
        pass
    try:
        import aiohttp

        out.append(aiohttp.ClientError)
    except ImportError:
        pass
    return tuple(out)


async def list_prefix(
    fs: Any, path: str, *, start_after: str = "", limit: int | None = None
) -> dict[str, int]:
    """``{bucket/key: size}`` of the objects under ``path/`` in key order (ListObjectsV2, 1,000
    per page): those after ``start_after`` (a ``bucket/key``), at most ``limit``."""
    bucket, key, _ = fs.split_path(path)
    prefix = key.rstrip("/") + "/" if key else ""
    out: dict[str, int] = {}
    kw: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
    if start_after:
        kw["StartAfter"] = fs.split_path(start_after)[1]
    while limit is None or len(out) < limit:
        kw["MaxKeys"] = 1000 if limit is None else min(1000, limit - len(out))
        page = await fs._call_s3("list_objects_v2", **kw)
        for obj in page.get("Contents", ()):
            out[f"{bucket}/{obj['Key']}"] = int(obj["Size"])
        token = page.get("NextContinuationToken")
        if not page.get("IsTruncated") or not token:
            break
        kw["ContinuationToken"] = token
    return out


async def delete_keys(fs: Any, paths: Sequence[str]) -> None:
    """Delete ``paths`` (one bucket) with DeleteObjects, 1,000 keys per request. Missing keys are
    not an error on S3; a key the server refused raises OSError naming it."""
    if not paths:
        return
    bucket = fs.split_path(paths[0])[0]
    keys = [fs.split_path(p)[1] for p in paths]
    for i in range(0, len(keys), 1000):
        objects = [{"Key": k} for k in keys[i : i + 1000]]
        out = await fs._call_s3(
            "delete_objects", Bucket=bucket, Delete={"Objects": objects, "Quiet": True}
        )
        errors = out.get("Errors") or []
        if errors:
            e = errors[0]
            raise OSError(f"s3://{bucket}/{e.get('Key')}: {e.get('Code')}: {e.get('Message')}")


def lifecycle_rule(prefix: str, days: int) -> dict[str, Any]:
    """A lifecycle rule that deletes this tier's objects ``days`` after they were written.

    A backstop, not the TTL: S3 counts from creation, so a rule also removes blocks that are
    still being hit (the sweeper honours refreshed expiry; the rule cannot). Choose ``days``
    well above the namespace TTL; a block removed early is rewritten by the next put.
    """
    if days <= 0:
        raise ValueError(f"lifecycle days must be positive, got {days}")
    prefix = prefix.strip("/")
    rule_id = "kvstore-" + hashlib.sha1(prefix.encode()).hexdigest()[:12]
    return {
        "ID": rule_id,
        "Filter": {"Prefix": f"{prefix}/" if prefix else ""},
        "Status": "Enabled",
        "Expiration": {"Days": int(days)},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    }


async def apply_lifecycle(fs: Any, base: str, days: int) -> dict[str, Any]:
    """Install (or update) :func:`lifecycle_rule` on the bucket of ``base``, keeping the bucket's
    other rules. Returns the rule."""
    bucket, prefix, _ = fs.split_path(base)
    rule = lifecycle_rule(prefix, days)
    try:
        current = await fs._call_s3("get_bucket_lifecycle_configuration", Bucket=bucket)
        rules = [r for r in current.get("Rules", []) if r.get("ID") != rule["ID"]]
    except FileNotFoundError:  # NoSuchLifecycleConfiguration
        rules = []
    except OSError as e:
        if "NoSuchLifecycleConfiguration" not in str(e):
            raise
        rules = []
    await fs._call_s3(
        "put_bucket_lifecycle_configuration",
        Bucket=bucket,
        LifecycleConfiguration={"Rules": [*rules, rule]},
    )
    return rule
