"""The wire formats, the ground floor both ends of a connection import: the data-plane frames
(:mod:`kvstore.wire.protocol`), descriptor passing over a Unix socket
(:mod:`kvstore.wire.fdpass`) and the KV event encoding, vLLM's structs
(:mod:`kvstore.wire.kvevents`). Standard library and msgspec only; no kvstore module above the
leaves, so the client and the router never import the daemon."""
