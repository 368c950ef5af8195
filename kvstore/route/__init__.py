"""Beyond one node: route requests to the node holding their prefix, and hand KV from a
prefill node to a decode node (``docs/routing.md``).

* :class:`Router` / :class:`Route` (``router.py``): follows the daemons' KV event streams
  (vLLM's ``KVEventBatch`` over ZeroMQ, :mod:`kvstore.wire.kvevents`, one :class:`~kvstore.route.feed.Feed` per
  stream) into one compact :class:`~kvstore.route.index.PrefixIndex`;
* :func:`offer` / :func:`receive` (``handoff.py``): the two sides of a handoff;
* ``python -m kvstore.route``: a router process answering over HTTP (``kvctl route`` too);
* :func:`control`: one call to a daemon's control plane or a router process
  (:func:`kvstore.client.control.control`; the handoff endpoints, benchmarks).
"""

from kvstore.client.control import control
from kvstore.route.handoff import Received, offer, receive
from kvstore.route.router import Route, Router

__all__ = ["Received", "Route", "Router", "control", "offer", "receive"]
