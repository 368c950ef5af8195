"""kvstore under vLLM: a v1 KV connector over the kvstore daemon.

Turn it on with one ``KVTransferConfig``::

    KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="engine.vllm.connector",
                     kv_role="kv_both", kv_connector_extra_config={"url": "http://127.0.0.1:7070"})

``engine.vllm.connector`` imports vLLM; the other modules here do not (config, breaker, pages are
tested without it). See docs/vllm.md.
"""
