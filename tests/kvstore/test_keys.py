"""Keys: golden vectors pin the hashes across processes, machines and releases."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from kvstore.errors import UsageError
from kvstore.keys import KVLayout, LayerGroup, Namespace, hash_blocks

LLAMA = Namespace(
    "meta-llama/Llama-3.1-8B",
    KVLayout("bfloat16", 16, (LayerGroup("full", 32, 8, 128),)),
    model_revision="0e9e39f",
)
DEEPSEEK = Namespace(
    "deepseek-ai/DeepSeek-V3",
    KVLayout("bfloat16", 64, (LayerGroup("mla", 61, latent_dim=512, rope_dim=64),)),
    rank=1,
    world_size=8,
    lora_id="sql-adapter",
    tenant_salt="t1",
)
GEMMA = Namespace(
    "google/gemma-3-27b",
    KVLayout(
        "float16",
        32,
        (LayerGroup("sliding", 52, 16, 128, window=1024), LayerGroup("full", 10, 16, 128)),
    ),
)

# Golden vectors: computed once by this implementation and pinned. If one of these changes,
# every cached block in every deployed store becomes unreachable: that is a schema change.
GOLDEN = {
    "llama_root": "164ecd8dead18a99d6c6becfc21a3e6b",
    "llama_0_48": [
        "8e1be38dc7b0f47e119ee7a34c8029d0",
        "59ed4dfd2855048a09c68f3db9bd7f1a",
        "a9286048c740039d09d8dd7bad2c7f7a",
    ],
    "llama_0_48_extra": [
        "d75dd6a652e8a0e1ff1c221ea6858e9a",
        "665d5b1e1e168001984df29fb45b3041",
        "3b8c220f1e1a1a741ce8535739f07c24",
    ],
    "deepseek_root": "65b6cf04d75b449fe46130f7955b3395",
    "deepseek_7x128": ["c234844c79c4bfc371fd74f41d29876f", "8123930c2840b97156a85420a41fb2b1"],
    "gemma_root": "497f2f469e8f99550540b239d353fa53",
}


def test_golden_roots() -> None:
    assert LLAMA.root.hex() == GOLDEN["llama_root"]
    assert DEEPSEEK.root.hex() == GOLDEN["deepseek_root"]
    assert GEMMA.root.hex() == GOLDEN["gemma_root"]


def test_golden_chains() -> None:
    assert [h.hex() for h in hash_blocks(LLAMA, list(range(48)))] == GOLDEN["llama_0_48"]
    assert [h.hex() for h in hash_blocks(LLAMA, list(range(48)), b"img:abc")] == GOLDEN["llama_0_48_extra"]
    assert [h.hex() for h in hash_blocks(DEEPSEEK, [7] * 128)] == GOLDEN["deepseek_7x128"]


def test_chain_matches_the_written_definition() -> None:
    """h_i = xxh3_128(h_{i-1} || token ids as little-endian int32 || extra), spelled out."""
    tokens = list(range(1000, 1048))
    prev = LLAMA.root
    expected = []
    for b in range(3):
        blk = struct.pack("<16i", *tokens[16 * b : 16 * b + 16])
        prev = xxhash.xxh3_128_digest(prev + blk + b"x")
        expected.append(prev)
    assert hash_blocks(LLAMA, tokens, b"x") == expected
    assert all(len(h) == 16 for h in expected)


def test_only_full_blocks_and_prefix_property() -> None:
    t = np.arange(100)
    full = hash_blocks(LLAMA, t)
    assert len(full) == 6  # 96 of 100 tokens
    assert hash_blocks(LLAMA, t[:40]) == full[:2]
    assert hash_blocks(LLAMA, t[:15]) == []
    changed = t.copy()
    changed[20] = 9
    h2 = hash_blocks(LLAMA, changed)
    assert h2[0] == full[0] and all(a != b for a, b in zip(h2[1:], full[1:], strict=True))


def test_a_chain_hashed_in_parts_is_the_chain_hashed_at_once() -> None:
    t = np.arange(100)
    full = hash_blocks(LLAMA, t)
    head = hash_blocks(LLAMA, t[:32])
    assert head + hash_blocks(LLAMA, t[32:], parent=head[-1]) == full
    extras = [bytes([i]) for i in range(6)]
    whole = hash_blocks(LLAMA, t, extras)
    assert hash_blocks(LLAMA, t[16:], extras[1:], parent=whole[0]) == whole[1:]


def test_input_types_agree() -> None:
    toks = [5, 1, 2**31 - 1, 0] * 16
    ref = hash_blocks(LLAMA, toks)
    assert hash_blocks(LLAMA, np.array(toks, dtype=np.int64)) == ref
    assert hash_blocks(LLAMA, np.array(toks, dtype=np.int32)) == ref
    assert hash_blocks(LLAMA, np.array(toks, dtype=">i4")) == ref  # big-endian input is converted
    torch = pytest.importorskip("torch")
    assert hash_blocks(LLAMA, torch.tensor(toks, dtype=torch.int64)) == ref
    assert hash_blocks(LLAMA, torch.tensor(toks, dtype=torch.int32)) == ref


def test_per_block_extra_keys() -> None:
    toks = list(range(48))
    per = hash_blocks(LLAMA, toks, [b"a", b"a", b"a"])
    assert per == hash_blocks(LLAMA, toks, b"a")
    assert hash_blocks(LLAMA, toks, [b"a", b"b", b"a"])[:1] == per[:1]
    assert hash_blocks(LLAMA, toks, [b"a", b"b", b"a"])[1] != per[1]
    with pytest.raises(UsageError, match="extra_keys"):
        hash_blocks(LLAMA, toks, [b"a"])


@pytest.mark.parametrize(
    "bad, msg",
    [([1.5] * 16, "integers"), ([[1] * 16], "1-D"), ([2**40] * 16, "int32")],
)
def test_bad_tokens(bad: object, msg: str) -> None:
    with pytest.raises(UsageError, match=msg):
        hash_blocks(LLAMA, bad)


def test_every_descriptor_field_changes_the_root() -> None:
    base = LLAMA.to_dict()
    variants = [
        {"model_revision": "other"},
        {"rank": 0, "world_size": 2},
        {"lora_id": "x"},
        {"tenant_salt": "s"},
        {"model_id": "other"},
    ]
    roots = {LLAMA.root}
    for v in variants:
        roots.add(Namespace.from_dict({**base, **v}).root)
    for layout in (
        KVLayout("float16", 16, (LayerGroup("full", 32, 8, 128),)),
        KVLayout("bfloat16", 32, (LayerGroup("full", 32, 8, 128),)),
        KVLayout("bfloat16", 16, (LayerGroup("full", 32, 4, 128),)),
        KVLayout("bfloat16", 16, (LayerGroup("sliding", 32, 8, 128, window=4096),)),
    ):
        roots.add(Namespace(LLAMA.model_id, layout, model_revision=LLAMA.model_revision).root)
    assert len(roots) == 1 + len(variants) + 4


def test_descriptor_round_trip_and_sizes() -> None:
    for ns in (LLAMA, DEEPSEEK, GEMMA):
        again = Namespace.from_dict(json.loads(json.dumps(ns.to_dict())))
        assert again == ns and again.root == ns.root
    assert LLAMA.block_bytes == 16 * 32 * 2 * 8 * 128 * 2
    assert DEEPSEEK.block_bytes == 64 * 61 * (512 + 64) * 2
    assert GEMMA.layout.num_layers == 62


@pytest.mark.parametrize(
    "make, msg",
    [
        (lambda: LayerGroup("rope", 1, 1, 1), "kind"),
        (lambda: LayerGroup("full", 0, 1, 1), "num_layers"),
        (lambda: LayerGroup("full", 2, 0, 1), "kv_heads"),
        (lambda: LayerGroup("mla", 2), "latent_dim"),
        (lambda: LayerGroup("sliding", 2, 1, 1), "window"),
        (lambda: KVLayout("int4", 16, (LayerGroup("full", 1, 1, 1),)), "dtype"),
        (lambda: KVLayout("bfloat16", 0, (LayerGroup("full", 1, 1, 1),)), "block_tokens"),
        (lambda: KVLayout("bfloat16", 16, ()), "at least one"),
        (lambda: Namespace("", LLAMA.layout), "model_id"),
        (lambda: Namespace("m", LLAMA.layout, hash_algo="md5"), "hash_algo"),
        (lambda: Namespace("m", LLAMA.layout, rank=2, world_size=2), "rank"),
        (lambda: Namespace("m", LLAMA.layout, schema_version=99), "schema_version"),
    ],
)
def test_invalid_descriptors(make: object, msg: str) -> None:
    with pytest.raises(UsageError, match=msg):
        make()  # type: ignore[operator]


def test_hashes_are_stable_across_processes() -> None:
    """Another interpreter with another hash seed computes the same bytes (no Python hash())."""
    code = (
        "from tests.kvstore.test_keys import LLAMA;"
        "from kvstore.keys import hash_blocks;"
        "print(','.join(h.hex() for h in hash_blocks(LLAMA, list(range(48)))))"
    )
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        assert out.split(",") == GOLDEN["llama_0_48"]
