"""The kvstore daemon: control plane (FastAPI), data plane (shared memory, TCP, UCX), tenants.

``kvstore serve --config kvstore.toml`` runs it; ``kvstore.client`` talks to it. Only
:mod:`kvstore.server.protocol` is imported by clients; the rest needs the ``server`` extra.
"""
