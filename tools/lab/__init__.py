"""Research and one-off probes: not installed, not part of ``make test`` (``make test-lab``).

Nothing in the product (``kvstore/``, ``tiers/``, ``eviction/``, ``engine/``, ``tools/bench/``,
``tools/replay/``) imports from here; code here may use anything.
"""
