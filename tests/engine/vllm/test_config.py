"""kv_connector_extra_config: parsed once, wrong keys and values refused with what to do."""

from __future__ import annotations

import pytest

from engine.vllm.config import ConnectorConfig
from kvstore.errors import ConfigError


def test_defaults_and_coercion() -> None:
    cfg = ConnectorConfig.from_extra({"url": "http://10.0.0.2:7070", "save": "false", "ttl_s": "3600",
                                      "max_pending_saves": 4})
    assert cfg.daemon_url == "http://10.0.0.2:7070" and cfg.save is False and cfg.ttl_s == 3600.0
    assert ConnectorConfig.from_extra(None).load_mode == "async"


def test_env_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_URL", "http://daemon:7070")
    monkeypatch.setenv("KVSTORE_TOKEN", "t0k")
    cfg = ConnectorConfig.from_extra({})
    assert cfg.daemon_url == "http://daemon:7070" and cfg.daemon_token == "t0k"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"urll": "x"}, "unknown key(s) urll; kvstore's connector knows url"),
        ({"plane": "rdma"}, "plane must be one of auto, shm, tcp, ucx"),
        ({"load_mode": "sync"}, "load_mode must be one of async, layerwise"),
        ({"lookup_timeout_s": 0}, "lookup_timeout_s must be > 0 seconds"),
        ({"save": "maybe"}, "save must be true or false"),
        ({"max_pending_saves": 2.5}, "max_pending_saves must be a whole number"),
        ({"ttl_s": "soon"}, "ttl_s must be a number"),
        ({"url": 7070}, "url must be a string"),
        ({"backoff_s": 5, "max_backoff_s": 1}, "max_backoff_s must be >= backoff_s"),
        ({"load_failure_policy": "retry"}, "load_failure_policy must be 'recompute' or 'fail'"),
        ({"sliding": "some"}, "sliding must be one of auto, window, every_layer"),
        ({"checkpoint_every_blocks": 0}, "checkpoint_every_blocks must be >= 1"),
        ({"block_format": "hf"}, "block_format must be 'vllm' or 'kvstore'"),
        ({"known_s": -1}, "known_s must be >= 0 seconds"),
    ],
)
def test_bad_values_say_what_to_do(extra: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ConnectorConfig.from_extra(extra)
