"""kvctl: the cache-inspection CLI (``kvctl --help``; docs/operations.md)."""
