"""Errors raised by kvstore.

A user's mistake (bad buffer, unknown namespace, bad config) raises a subclass of
:class:`UsageError` whose message says what to do. Conditions of the store (a full tier, a
corrupt payload) have their own types so that callers can treat them as misses or retry.
"""

from __future__ import annotations


class KVStoreError(Exception):
    """Base class of every error kvstore raises on purpose."""


class UsageError(KVStoreError, ValueError):
    """The caller asked for something invalid; the message says how to fix it."""


class ConfigError(UsageError):
    """The configuration file or environment holds an invalid value."""


class UnknownNamespaceError(UsageError, KeyError):
    """A namespace was used before :meth:`KVStore.register_namespace`."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable.
        return str(self.args[0]) if self.args else ""


class LayoutMismatchError(UsageError):
    """A namespace names a model that is registered with a different KV layout.

    Reported instead of becoming a silent miss: the engine and the store disagree on what a
    block holds.
    """


class BufferSizeError(UsageError):
    """A caller buffer does not have the size a block needs."""


class RetentionError(UsageError):
    """A retention guarantee (a pin with a deadline) cannot be honoured; nothing was pinned."""


class MissingPrefixError(UsageError):
    """A put's leading blocks are neither cached nor supplied; the store stays prefix-closed."""


class BlockNotFound(KVStoreError, KeyError):
    """The tier or store does not hold the block (a miss)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CorruptBlockError(KVStoreError):
    """A payload failed its checksum or header check. Callers treat it as a miss."""


class TierFullError(KVStoreError):
    """The tier has no room for the payload until something is evicted from it."""


class TierIOError(KVStoreError, OSError):
    """The tier's device failed (disk full, unwritable directory, I/O error)."""


class TierUnavailableError(TierIOError):
    """The tier cannot be reached now (its server is down or timed out; its circuit breaker is
    open). Nothing is wrong with the block: treat it as a miss and keep the block's entry, the
    tier comes back by itself."""


# ---- the daemon and its clients (kvstore/server, kvstore/client) --------------------------------


class AuthError(KVStoreError):
    """No bearer token, or one the daemon does not know."""


class ForbiddenError(KVStoreError):
    """The tenant may not do this (an admin-only call; shared memory not granted)."""


class QuotaExceededError(KVStoreError):
    """The tenant's quota has no room for the request."""


class DaemonUnavailableError(KVStoreError, ConnectionError):
    """The daemon could not be reached, or went away, and retries did not help."""


# ---- error kinds on the wire --------------------------------------------------------------------
# The daemon's HTTP error bodies name the error as ``"kind"``: the name of its class in this module
# (the most specific one), so that a client raises the same type the in-process store would.
# The class names are part of the daemon's API: renaming one changes what old clients see.

KINDS: dict[str, type[KVStoreError]] = {
    name: cls for name, cls in dict(globals()).items()
    if isinstance(cls, type) and issubclass(cls, KVStoreError)
}
"""Every error class of this module by name (what an HTTP error body's ``kind`` names)."""


def error_kind(exc: BaseException) -> str | None:
    """The wire kind of ``exc``: the name of the most specific class of this module it is an
    instance of (a subclass defined elsewhere reports its base here); None for other errors."""
    for cls in type(exc).__mro__:
        if KINDS.get(cls.__name__) is cls:
            return cls.__name__
    return None


def error_class(kind: object) -> type[KVStoreError] | None:
    """The class a wire ``kind`` names, or None for one this version does not know."""
    return KINDS.get(kind) if isinstance(kind, str) else None
