"""Client library of the kvstore daemon: ``connect(url)`` returns a :class:`Client` with the
store's API (shared memory when the daemon is on this node, else TCP; UCX on request)."""

from kvstore.client.client import Client, ClientLease, ClientPin, connect

__all__ = ["Client", "ClientLease", "ClientPin", "connect"]
