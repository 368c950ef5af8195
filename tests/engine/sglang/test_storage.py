"""The SGLang HiCache backend against SGLang's own interface, with HiCacheFile (SGLang's
reference backend) run on the same calls as the expected behaviour; and the daemon killed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage", reason="SGLang is not installed here: run `make test-vllm`")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from engine.sglang.storage import KVStoreHiCache  # noqa: E402
from engine.vllm.harness import small_daemon  # noqa: E402
from kvstore.client.spawn import LocalDaemon  # noqa: E402
from kvstore.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.sglang

LAYERS, HEADS, DIM, PAGE = 2, 2, 32, 16


class HostPool:
    """A page-first MHA host pool with the HostKVCache methods the backends use."""

    layout = "page_first"
    page_size, layer_num, head_num, head_dim, dtype = PAGE, LAYERS, HEADS, DIM, torch.bfloat16

    def __init__(self, pages: int, layout: str = "page_first") -> None:
        self.layout = layout
        self.kv_buffer = torch.zeros((pages, LAYERS, 2, PAGE, HEADS, DIM), dtype=torch.bfloat16)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        return self.kv_buffer[index // PAGE].flatten().clone()

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(self.kv_buffer[0].numel(), dtype=torch.bfloat16)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        self.kv_buffer[index // PAGE] = data_page.view(self.kv_buffer.shape[1:])

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        rows = (indices[::PAGE] // PAGE).tolist()
        size = self.kv_buffer[0].numel() * 2
        return [self.kv_buffer[r].data_ptr() for r in rows], [size] * len(rows)

    def fill(self, page: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer[page] = torch.randn(self.kv_buffer.shape[1:], generator=g).to(torch.bfloat16)


def _config(extra: dict[str, Any], tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name="org/tiny", extra_config=extra)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalDaemon]:
    with small_daemon(tmp_path_factory.mktemp("daemon"), dram="64MiB") as d:
        yield d


def _dynamic(url: str, **extra: Any) -> dict[str, Any]:
    # A generous call timeout: a healthy daemon on a loaded 2-core CI box can take seconds to
    # answer, and a timeout would open the breaker (a miss where the test expects a hit). The
    # kill test's dead daemon refuses connections at once, whatever the timeout.
    return {"backend_name": "kvstore", "module_path": "engine.sglang.storage", "class_name": "KVStoreHiCache",
            "url": url, "timeout_s": 60, **extra}


@pytest.fixture
def backends(daemon: LocalDaemon, tmp_path: Path) -> Iterator[tuple[Any, HiCacheFile, HostPool]]:
    pool = HostPool(16)
    ours = StorageBackendFactory.create_backend("dynamic", _config(_dynamic(daemon.url, model_id=str(tmp_path))), pool)
    ours.register_mem_pool_host(pool)
    ref = HiCacheFile(_config({"file_storage_path": str(tmp_path / "file")}))
    ref.register_mem_pool_host(pool)
    ref.register_mem_host_pool_v2(pool, PoolName.KV)
    ours.register_mem_host_pool_v2(pool, PoolName.KV)
    yield ours, ref, pool
    ours.close()


def test_loaded_by_sglangs_factory_as_a_dynamic_backend(backends: tuple[Any, HiCacheFile, HostPool]) -> None:
    ours, _, _ = backends
    assert isinstance(ours, KVStoreHiCache) or isinstance(getattr(ours, "_backend", None), KVStoreHiCache)


def test_set_get_exists_match_hicachefile(backends: tuple[Any, HiCacheFile, HostPool]) -> None:
    ours, ref, pool = backends
    keys = [f"{i:064x}" for i in range(1, 6)]
    values = [torch.randn(pool.kv_buffer[0].numel()).to(torch.bfloat16) for _ in keys]
    for b in (ours, ref):
        assert b.batch_exists(keys) == 0 and not b.exists(keys[0])
        assert b.set(keys[0], values[0]) is True
        assert b.batch_set(keys[1:], values[1:]) is True
        assert b.exists(keys[3]) and b.batch_exists(keys) == 5
        assert b.batch_exists([*keys[:2], "f" * 64]) == 2
    for b in (ours, ref):
        got = b.batch_get(keys, [torch.empty_like(v) for v in values])
        assert all(torch.equal(g, v) for g, v in zip(got, values, strict=True))
        one = b.get(keys[2], torch.empty_like(values[2]))
        assert one is not None and torch.equal(one, values[2])
        assert b.get("e" * 64, torch.empty_like(values[0])) is None


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_v1_and_v2_round_trips_through_the_host_pool(backends: tuple[Any, HiCacheFile, HostPool], layout: str) -> None:
    ours, ref, pool = backends
    pool.layout = layout  # layer_first: copies through flat pages; page_first: straight to the pages
    for p in range(4):
        pool.fill(p, seed=p)
    saved = pool.kv_buffer[:4].clone()
    keys = [f"{layout}{i:060x}" for i in range(4)]
    idx = torch.arange(0, 4 * PAGE)
    assert ours.batch_set_v1(keys[:2], idx[: 2 * PAGE]) == [True, True]
    info = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    assert ours.batch_set_v1(keys[2:], idx[2 * PAGE :], info) == [True, True]  # continues the chain
    assert ref.batch_set_v2([PoolTransfer(PoolName.KV, host_indices=idx, keys=keys)]) == {PoolName.KV: [True] * 4}
    assert ours.batch_exists_v2(keys).kv_hit_pages == ref.batch_exists_v2(keys).kv_hit_pages == 4
    dst = torch.arange(8 * PAGE, 12 * PAGE)  # load into pages 8..11
    assert ours.batch_get_v1(keys, dst) == [True] * 4
    assert torch.equal(pool.kv_buffer[8:12], saved)
    pool.kv_buffer[8:12] = 0
    assert ours.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=dst, keys=keys)]) == \
        ref.batch_get_v2([PoolTransfer(PoolName.KV, host_indices=dst, keys=keys)]) == {PoolName.KV: [True] * 4}
    assert torch.equal(pool.kv_buffer[8:12], saved)
    missing = [*keys[:2], "d" * 64, keys[3]]
    assert ours.batch_get_v1(missing, dst)[:3] == [True, True, False]  # the leading present pages


def test_ranks_and_models_are_apart(daemon: LocalDaemon, tmp_path: Path) -> None:
    pool = HostPool(4)
    pool.fill(0, seed=9)
    a = KVStoreHiCache(_config(_dynamic(daemon.url, model_id="m-apart"), tp_rank=0, tp_size=2))
    b = KVStoreHiCache(_config(_dynamic(daemon.url, model_id="m-apart"), tp_rank=1, tp_size=2))
    for x in (a, b):
        x.register_mem_pool_host(pool)
    assert a.batch_set_v1(["k" * 64], torch.arange(PAGE)) == [True]
    assert a.exists("k" * 64) and not b.exists("k" * 64)
    a.close()
    b.close()


def test_daemon_down_is_a_miss_and_a_dropped_write(tmp_path: Path) -> None:
    d = small_daemon(tmp_path / "d", dram="64MiB")
    pool = HostPool(4)
    pool.fill(0, seed=3)
    s = KVStoreHiCache(_config(_dynamic(d.url, backoff_s=60, max_backoff_s=60)))
    s.register_mem_pool_host(pool)
    assert s.batch_set_v1(["a" * 64], torch.arange(PAGE)) == [True]
    d.kill()
    assert s.batch_exists(["a" * 64]) == 0  # finds the daemon gone: opens the breaker
    calls = s.link.counters.calls
    assert s.batch_get_v1(["a" * 64], torch.arange(PAGE, 2 * PAGE)) == [False]
    assert s.batch_set_v1(["b" * 64], torch.arange(PAGE)) == [False]
    assert s.link.counters.short_circuited == s.link.counters.calls - calls == 2  # no connection tried
    assert s.get_stats()["dropped_pages"] == 1
    s.close()


def test_bad_extra_config_names_the_keys(daemon: LocalDaemon) -> None:
    with pytest.raises(ConfigError, match="unknown key.*urll"):
        KVStoreHiCache(_config({"urll": daemon.url}))
