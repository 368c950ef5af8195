"""The kvstore daemon: control plane (FastAPI), data plane (shared memory, TCP, UCX), tenants.

``kvstore serve --config kvstore.toml`` runs it; ``kvstore.client`` talks to it. Clients import
the wire formats from :mod:`kvstore.wire`, never this package, which needs the ``server`` extra.
"""
