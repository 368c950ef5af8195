"""Trace replay: hit rates of every eviction policy against LRU, Belady's optimum and an unlimited
cache, through the store's real decision code (``python -m tools.replay --help``)."""
