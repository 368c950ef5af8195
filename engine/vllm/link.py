"""What each side of the vLLM connector (the scheduler's, each worker's) sets up towards the
daemon: the namespace a deployment stores under and the breaker-guarded link that registers it
on every (re)connection. Importable without vLLM."""

from __future__ import annotations

import logging
from typing import Any

from engine.breaker import DaemonLink
from engine.vllm.config import ConnectorConfig
from kvstore.client import Client, connect
from kvstore.hybrid import HybridNamespaces
from kvstore.keys import Namespace

log = logging.getLogger("kvstore.vllm")


def model_identity(vllm_config: Any, cfg: ConnectorConfig) -> tuple[str, str]:
    mc = vllm_config.model_config
    model_id = cfg.model_id or str(mc.model)
    revision = cfg.model_revision or str(getattr(mc, "revision", None) or "main")
    quant = getattr(mc, "quantization", None)
    if quant:  # quantised weights compute other K/V
        revision = f"{revision}+{quant}"
    return model_id, revision


def chain_namespace(ns: Namespace) -> Namespace:
    """The namespace a request's block hashes are rooted in: ``ns``, or for a page with sliding
    or recurrent layers its hybrid parts' (``HybridNamespaces.chain_ns``: the keys the reference
    engine's hybrid store uses too)."""
    if _split(ns):
        return HybridNamespaces.of(ns).chain_ns
    return ns


def stored_namespaces(ns: Namespace) -> list[Namespace]:
    """The namespaces blocks of ``ns`` are stored under: ``ns``, or a page with sliding or
    recurrent layers' hybrid parts (full, window, state)."""
    if _split(ns):
        return HybridNamespaces.of(ns).parts()
    return [ns]


def _split(ns: Namespace) -> bool:
    return any(g.kind in ("sliding", "recurrent") for g in ns.layout.groups)


def make_link(cfg: ConnectorConfig, name: str, timeout: float, namespaces: list[Namespace],
              report_conflicts: bool = False) -> DaemonLink[Client]:
    """A breaker-guarded client that registers ``namespaces`` on every (re)connection;
    ``report_conflicts``: say loudly when the daemon holds this model deployment under another
    page layout (one link per engine does, the scheduler's)."""
    ttl = cfg.ttl_s or None

    def make() -> Client:
        return connect(cfg.daemon_url, token=cfg.daemon_token, plane=cfg.plane, timeout=timeout, retries=0)

    def on_connect(client: Client) -> None:
        for ns in namespaces:
            client.register_namespace(ns, ttl)
        mine = {bytes(ns.root).hex() for ns in namespaces}
        for w in client.layout_conflicts if report_conflicts else ():
            if w["namespaces"][0] in mine:
                log.warning(
                    "kvstore: the daemon already holds %r under another KV page layout (%s): this engine "
                    "and the one that stored those blocks never share them. If that is not meant, give "
                    "vLLM the same --block-size, --dtype and --kv-cache-dtype as that engine",
                    w["model_id"], "; ".join(w["differences"]),
                )

    return DaemonLink(make, name=name, on_connect=on_connect, backoff_s=cfg.backoff_s, max_backoff_s=cfg.max_backoff_s)
