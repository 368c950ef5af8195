"""kvstore under SGLang: a HiCache storage backend over the kvstore daemon (``engine.sglang.storage``).
See docs/sglang.md."""
