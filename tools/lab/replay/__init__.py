"""Eviction research on request traces: bounds, tier economics, admission references (``docs/eviction.md``)."""
