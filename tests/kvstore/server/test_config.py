"""[server] and [[tenants]]: loaded from the store's TOML file, validated, tokens never printed."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.config import load_config
from kvstore.errors import ConfigError
from kvstore.server.config import TenantSpec, load_server_config

TOML = """
[store]
root = "{root}"

[server]
http_port = 8000
max_body = "1MiB"
maintain_interval = "1min"
put_device_timeout = "2.5s"

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
    assert cfg.limits.put_device_timeout_s == 2.5
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
        ('[server]\nput_device_timeout = "0s"\n', {}, "put_device_timeout must be a positive duration"),
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


def _tenant_toml(line: str) -> str:
    return f'[[tenants]]\nname = "a"\ntoken = "0123456789abcdefg"\n{line}\n'


@pytest.mark.parametrize(
    ("line", "want"),
    [("", None), ('pin_quota = "8GiB"', 8 << 30), ("pin_quota = 4096", 4096), ('pin_quota = "1.5KiB"', 1536),
     ("pin_quota = 0", 0)],
)
def test_pin_quota_takes_a_size_and_defaults_to_no_limit(tmp_path: Path, line: str, want: int | None) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(_tenant_toml(line))
    (a,) = load_server_config(path, env={}).tenants
    assert a.pin_quota_bytes == want
    assert f"pin_quota_bytes={want}" in repr(a)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ('pin_quota = "lots"', r"\[\[tenants\]\] #1.pin_quota: cannot read 'lots' as a size"),
        ("pin_quota = -1", "pin_quota: a size cannot be negative"),
        ('pin_quota = "-4KiB"', "pin_quota: cannot read"),
        ("pin_quota = true", "pin_quota: expected a size"),
        ("pin_quota = nan", "pin_quota: cannot read nan"),
        ("pin_quota = inf", "pin_quota: cannot read inf"),
        ("pin_quota = [1]", "pin_quota: cannot read"),
        ("quota = inf", r"quota: cannot read inf"),
    ],
)
def test_bad_pin_quotas_say_what_to_write(tmp_path: Path, line: str, words: str) -> None:
    path = tmp_path / "kvstore.toml"
    path.write_text(_tenant_toml(line))
    with pytest.raises(ConfigError, match=words):
        load_server_config(path, env={})


@pytest.mark.parametrize("bad", [-1, 1.5, "8GiB", True])
def test_a_tenant_spec_refuses_a_pin_quota_that_is_not_bytes(bad: object) -> None:
    with pytest.raises(ConfigError, match="pin_quota must be a size"):
        TenantSpec("a", "0123456789abcdefg", pin_quota_bytes=bad)  # type: ignore[arg-type]
