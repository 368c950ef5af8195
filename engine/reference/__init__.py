"""Reference engines and demos over ``KVCacheAPI``: not adapters (``engine/vllm``, ``engine/sglang``)."""
