"""Client library of the kvstore daemon: ``connect(url)`` returns a :class:`Client` with the
store's API (shared memory when the daemon is on this node, else TCP; UCX on request);
:class:`ControlClient` is the daemon's control plane, the admin API included."""

from kvstore.client.client import Client, ClientLease, ClientPin, connect
from kvstore.client.control import ControlClient

__all__ = ["Client", "ClientLease", "ClientPin", "ControlClient", "connect"]
