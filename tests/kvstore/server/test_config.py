"""[server] and [[tenants]]: loaded from the store's TOML file, validated, tokens never printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.server.config import load_server_config

TOML = """
[store]
root = "{root}"

[server]
http_port = 8000
max_body = "1MiB"
maintain_interval = "1min"

[[tenants]]
name = "team-a"
token_env = "TEAM_A_TOKEN"
quota = "2GiB"
allow_shm = true

[[tenants]]
name = "ops"
token = "ops-token-0123456789abcdef"
admin = true
"""


def test_load_from_the_store_file(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(TOML.format(root=tmp_path / "data"))
    env = {"TEAM_A_TOKEN": "a-token-0123456789abcdef", "KVSTORE_SERVER_DATA_PORT": "9001"}
    cfg = load_server_config(path, env=env)
    assert (cfg.http_port, cfg.data_port, cfg.maintain_interval_s) == (8000, 9001, 60.0)
    assert cfg.limits.max_body_bytes == 1 << 20
    a, ops = cfg.tenants
    assert (a.name, a.quota_bytes, a.allow_shm, a.admin) == ("team-a", 2 << 30, True, False)
    assert ops.admin and not ops.allow_shm
    assert "0123456789" not in repr(cfg)
    assert load_config(path, env={}).root == tmp_path / "data"  # the store reads the same file


@pytest.mark.parametrize(
    ("toml", "env", "words"),
    [
        ('[server]\nhost = "0.0.0.0"\n', {}, "loopback"),
        ("[server]\nucx = true\n", {}, "binds every"),
        ("[server]\nhttp_port = 70000\n", {}, "outside"),
        ("[server]\nbogus = 1\n", {}, "unknown key"),
        ('[server]\nmax_body = "lots"\n', {}, "size"),
        ('[[tenants]]\nname = "a"\ntoken_env = "NOPE"\n', {}, "NOPE"),
        ('[[tenants]]\nname = "a"\n', {}, "needs token"),
        ('[[tenants]]\nname = "default"\ntoken = "0123456789abcdefg"\n', {}, "reserved"),
        ('[[tenants]]\nname = "a"\ntoken = "0123456789abcdefg"\n[[tenants]]\nname = "b"\ntoken = "0123456789abcdefg"\n',
         {}, "unique"),
        ('[[tenants]]\nname = "a"\ntoken = "0123456789abcdefg"\ncolour = "red"\n', {}, "unknown key"),
    ],
)
def test_invalid_configs_say_what_to_fix(tmp_path: Path, toml: str, env: dict[str, str], words: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=words):
        load_server_config(path, env=env)


def test_a_public_address_is_fine_with_tenants(tmp_path: Path) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text('[server]\nhost = "0.0.0.0"\n[[tenants]]\nname = "a"\ntoken = "0123456789abcdefg"\n')
    assert load_server_config(path, env={}).host == "0.0.0.0"
