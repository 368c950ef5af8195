"""Both sides of a prefill -> decode handoff (the daemon's side: ``kvstore/server/handoff.py``).

Prefill node::

    offer(client, ns, hashes, kv, request_id, ttl_s=30)    # put + hold until confirmed or 30 s

Decode node (another machine; the orchestrator told it the request id and the prefill node)::

    got = receive(prefill_url, ns, hashes, dst, request_id)
    if got.recompute:            # unreachable, lost in a restart, expired: compute the rest
        prefill(tokens[got.blocks * ns.block_tokens:])

``receive`` loads over TCP by default (``plane="ucx"`` where the daemons run UCX) straight
into ``dst`` and confirms, which releases the prefill node's hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.client import Client, connect
from kvstore.client.control import ControlClient
from kvstore.errors import BlockNotFound, DaemonUnavailableError, KVStoreError
from kvstore.keys import Namespace


@dataclass(frozen=True, slots=True)
class Received:
    blocks: int
    """Leading blocks loaded into ``dst``."""
    recompute: bool
    """The caller must compute the blocks from ``blocks`` on itself."""
    state: str
    """The handoff as the decode side saw it: ``released`` (loaded and confirmed), ``ready``
    (loaded, the confirm failed: the deadline releases it), ``lost``, ``expired``,
    ``unknown`` (never offered) or ``unreachable`` (the prefill node did not answer)."""
    reason: str = ""


def offer(client: Client, ns: Namespace, hashes: Sequence[bytes], blocks: Any, request_id: str, *,
          ttl_s: float = 30.0, durable: bool = False, start: int = 0, token: str | None = None,
          timeout: float = 30.0) -> dict[str, Any]:
    """Put ``blocks`` (``hashes[start:]``) and hold the chain for a decode node. ``durable``:
    synced to a persistent tier and kept through a daemon restart (the hold's call waits up to
    ``timeout`` for that copy)."""
    client.put(ns, hashes, blocks, start=start, durable=durable)
    with ControlClient(client.url, token=token, timeout=timeout) as daemon:
        return daemon.offer_handoff(bytes(ns.root).hex(), [bytes(h).hex() for h in hashes], request_id,
                                    ttl_s=ttl_s, durable=durable)


def receive(url: str, ns: Namespace, hashes: Sequence[bytes], dst: Any, request_id: str, *,
            token: str | None = None, plane: str = "tcp", timeout: float = 5.0) -> Received:
    """Load a handoff from the prefill node at ``url`` into ``dst`` and confirm it. Never
    raises for what a decode node handles by recomputing (see :attr:`Received.state`)."""
    with ControlClient(url, token=token, timeout=timeout) as daemon:
        return _receive(daemon, ns, hashes, dst, request_id, token, plane, timeout)


def _receive(daemon: ControlClient, ns: Namespace, hashes: Sequence[bytes], dst: Any, request_id: str,
             token: str | None, plane: str, timeout: float) -> Received:
    url = daemon.url
    try:
        st = daemon.handoff(request_id)
    except DaemonUnavailableError as e:
        return Received(0, True, "unreachable", str(e))
    except BlockNotFound as e:
        return Received(0, True, "unknown", str(e))
    if st["state"] != "ready":
        return Received(0, True, st["state"], st.get("reason", ""))
    try:
        with connect(url, token=token, plane=plane, timeout=timeout, retries=1) as c:
            c.register_namespace(ns)
            n = c.get_into(ns, hashes, dst)
    except (DaemonUnavailableError, ConnectionError) as e:
        return Received(0, True, "unreachable", str(e))
    if n < len(hashes):
        return Received(n, True, "ready", f"only {n} of {len(hashes)} blocks were there")
    try:
        daemon.confirm_handoff(request_id)
    except KVStoreError as e:  # the KV is here; the prefill node's deadline ends the hold
        return Received(n, False, "ready", f"confirm failed: {e}")
    return Received(n, False, "released")
