"""The connector's daemon link against a real daemon: another vLLM page (block size, dtype) of
the same model is another namespace, and the daemon's report of it is loud in vLLM's log."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM's CPU build is not installed here: run `make test-vllm`")

from engine.vllm.config import ConnectorConfig  # noqa: E402
from engine.vllm.harness import small_daemon  # noqa: E402
from engine.vllm.link import make_link  # noqa: E402
from engine.vllm.pages import PageSpec  # noqa: E402
from kvstore.client import connect  # noqa: E402
from kvstore.keys import Namespace, hash_blocks  # noqa: E402

pytestmark = pytest.mark.vllm

SPEC = PageSpec(("model.layers.0.attn", "model.layers.1.attn"), 32, 2, 64, torch.bfloat16, "LBHNC")


@pytest.mark.parametrize(("other", "field"), [(replace(SPEC, block_size=64), "block_tokens"),
                                              (replace(SPEC, dtype=torch.float16), "dtype")])
def test_another_page_of_one_model_is_reported_loudly(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      other: PageSpec, field: str) -> None:
    ns, changed = SPEC.namespace("org/m", "main", 0, 1), other.namespace("org/m", "main", 0, 1)
    assert changed.root != ns.root  # the blocks never mix
    with small_daemon(tmp_path, dram="16MiB") as d:
        cfg = ConnectorConfig(url=d.url, lookup_timeout_s=60)
        first = make_link(cfg, "first", 60, [ns], report_conflicts=True)
        assert not first.is_open
        with caplog.at_level(logging.WARNING, logger="kvstore.vllm"):
            empty = make_link(cfg, "empty", 60, [changed], report_conflicts=True)
        empty.close()  # the first engine stored nothing yet (a failed start): no conflict to report
        assert not [r for r in caplog.records if r.name == "kvstore.vllm"]
        _store_one_block(d.url, ns)  # now the first engine's layout holds blocks
        with caplog.at_level(logging.WARNING, logger="kvstore.vllm"):
            second = make_link(cfg, "second", 60, [changed], report_conflicts=True)
        assert not second.is_open  # both layouts stay usable: the engine runs, with the cache
        first.close()
        second.close()
    [msg] = [r.getMessage() for r in caplog.records if r.name == "kvstore.vllm"]
    assert "under another KV page layout" in msg and field in msg and "--block-size" in msg


def _store_one_block(url: str, ns: Namespace) -> None:
    with connect(url, plane="tcp") as c:
        c.register_namespace(ns)
        (h,) = hash_blocks(ns, np.arange(ns.block_tokens))
        c.put(ns, [h], [bytes(ns.block_bytes)])
