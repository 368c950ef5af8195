"""Config: TOML file + environment overrides, frozen, validated on load."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from kvstore.config import DEFAULT_TTL_S, StoreConfig, TierSpec, load_config
from kvstore.errors import ConfigError
from kvstore.registry import build_config, make_tier
from kvstore.units import parse_duration, parse_size


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "kvstore.toml"
    p.write_text(text)
    return p


def test_defaults_are_embedded_and_72h() -> None:
    cfg = load_config(env={})
    assert cfg.default_ttl_s == DEFAULT_TTL_S == 72 * 3600
    assert [t.kind for t in cfg.tiers] == ["dram", "nvme", "object"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.policy = "x"  # type: ignore[misc]


def test_file_and_environment_overrides(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        """
[store]
root = "/srv/kv"
default_ttl = "24h"

[[tiers]]
name = "dram"
kind = "dram"
capacity_bytes = "1GiB"

[[tiers]]
name = "disk"
kind = "nvme"
capacity_bytes = "10GiB"
direct_io = true
""",
    )
    cfg = load_config(
        p,
        env={
            "KVSTORE_DEFAULT_TTL": "3d",
            "KVSTORE_TIER_DISK_DIRECT_IO": "false",
            "KVSTORE_TIER_DRAM_CAPACITY_BYTES": "2GiB",
        },
    )
    assert cfg.root == Path("/srv/kv")
    assert cfg.default_ttl_s == 3 * 86400
    assert [t.name for t in cfg.tiers] == ["dram", "disk"]
    assert cfg.tiers[0].options["capacity_bytes"] == "2GiB"
    assert cfg.tiers[1].options["direct_io"] == "false"


@pytest.mark.parametrize(
    "text, msg",
    [
        ("[store]\nbogus = 1\n", "unknown key 'bogus'"),
        ("[stor]\n", "unknown table"),
        ("[store]\ndefault_ttl = '-3h'\n", "duration"),
        ("[store]\ndefault_ttl = 'soon'\n", "duration"),
        ("[[tiers]]\nname='a'\n", "needs kind"),
        ("[[tiers]]\nname='a'\nkind='dram'\n[[tiers]]\nname='a'\nkind='nvme'\n", "unique"),
        ("[[tiers]]\nname='a b'\nkind='dram'\n", "name"),
        ("this is not toml", "TOML"),
    ],
)
def test_invalid_files(tmp_path: Path, text: str, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        load_config(write(tmp_path, text), env={})


def test_missing_file_and_bad_values() -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/nonexistent/kvstore.toml", env={})
    with pytest.raises(ConfigError, match="at least one tier"):
        StoreConfig(tiers=())
    with pytest.raises(ConfigError, match="positive"):
        StoreConfig(default_ttl_s=0)


def test_units() -> None:
    assert parse_size("4GiB") == 4 << 30
    assert parse_size("1.5 MB") == 1_500_000
    assert parse_size(4096) == 4096
    assert parse_duration("72h") == 259200
    assert parse_duration("30min") == 1800
    for bad in ("4XB", "", "-1", True):
        with pytest.raises(ConfigError):
            parse_size(bad)  # type: ignore[arg-type]


def test_tier_options_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown tier kind 'tape'"):
        make_tier("tape", "t", {}, tmp_path)
    with pytest.raises(ConfigError, match="unknown option"):
        make_tier("dram", "d", {"capacity_bytes": "1MiB", "colour": "red"}, tmp_path)
    with pytest.raises(ConfigError, match="true or false"):
        from tiers.nvme import NvmeTier

        build_config(NvmeTier.Config, {"capacity_bytes": "1MiB", "direct_io": "maybe"}, "t")


def test_tier_spec_options_are_read_only() -> None:
    spec = TierSpec("dram", "dram", {"capacity_bytes": 1})
    with pytest.raises(TypeError):
        spec.options["capacity_bytes"] = 2  # type: ignore[index]


# ---- environment overrides: refused when wrong, and named by their variable -----------------------


def test_misspelled_tier_in_environment_is_refused_listing_the_tiers() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(env={"KVSTORE_TIER_DRAMM_CAPACITY_BYTES": "2GiB"})
    msg = str(err.value)
    assert "KVSTORE_TIER_DRAMM_CAPACITY_BYTES" in msg
    assert "known tiers: dram, nvme, object" in msg


def test_unknown_tier_option_in_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"KVSTORE_TIER_NVME_CAPACITY: tier 'nvme' \(nvme\) has no option 'capacity'"):
        load_config(env={"KVSTORE_TIER_NVME_CAPACITY": "2GiB"})


@pytest.mark.parametrize(
    "var, value",
    [
        ("KVSTORE_TIER_DRAM_CAPACITY_BYTES", "lots"),
        ("KVSTORE_DEFAULT_TTL", "soon"),
        ("KVSTORE_POLICY", "densty"),
        ("KVSTORE_EVENTS_ENABLED", "maybe"),
    ],
)
def test_bad_environment_value_names_the_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config(env={var: value})


def test_cross_option_error_from_environment_names_the_variables() -> None:
    with pytest.raises(ConfigError, match=r"KVSTORE_TIER_NVME_SLAB_BYTES='2GiB' from the environment"):
        load_config(env={"KVSTORE_TIER_NVME_SLAB_BYTES": "2GiB"})


def test_longest_tier_prefix_owns_the_variable(tmp_path: Path) -> None:
    p = write(tmp_path, "[[tiers]]\nname='nvme'\nkind='nvme'\ncapacity_bytes='1GiB'\n"
                        "[[tiers]]\nname='nvme_fast'\nkind='nvme'\ncapacity_bytes='1GiB'\n")
    cfg = load_config(p, env={"KVSTORE_TIER_NVME_FAST_CAPACITY_BYTES": "2GiB"})
    assert cfg.tiers[0].options["capacity_bytes"] == "1GiB"
    assert cfg.tiers[1].options["capacity_bytes"] == "2GiB"
