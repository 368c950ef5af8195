"""The data-plane frame format: round trips, and a property-based fuzz of every parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.wire import protocol as P

LIMITS = P.WireLimits(max_meta_bytes=64 + 16 * 64, max_payload_bytes=1 << 20)
hashes16 = st.lists(st.binary(min_size=16, max_size=16), max_size=64)


def test_header_round_trip_and_checksum() -> None:
    meta = P.encode_blocks(b"n" * 16, [b"h" * 16, b"i" * 16])
    head = P.encode_header(P.Op.GET, 7, meta, 0)
    hdr = P.parse_header(head, LIMITS)
    assert (hdr.op, hdr.req_id, hdr.meta_len, hdr.payload_len) == (P.Op.GET, 7, len(meta), 0)
    P.check_crc(head, meta, hdr.crc)
    with pytest.raises(P.ProtocolError, match="checksum"):
        P.check_crc(head, meta[:-1] + b"x", hdr.crc)


@pytest.mark.parametrize(
    ("mutate", "code"),
    [
        (lambda h: b"HTTP" + h[4:], P.ErrorCode.BAD_FRAME),  # someone spoke HTTP to the data port
        (lambda h: h[:4] + bytes([9]) + h[5:], P.ErrorCode.BAD_FRAME),  # a future version
        (lambda h: h[:5] + bytes([0x42]) + h[6:], P.ErrorCode.BAD_FRAME),  # unknown op
        (lambda h: h[:6] + b"\x01\x00" + h[8:], P.ErrorCode.BAD_FRAME),  # unknown flags
        (lambda h: h[:12] + (10**6).to_bytes(4, "little") + h[16:], P.ErrorCode.TOO_LARGE),
        (lambda h: h[:16] + (1 << 40).to_bytes(8, "little") + h[24:], P.ErrorCode.TOO_LARGE),
        (lambda h: h[:20], P.ErrorCode.BAD_FRAME),
    ],
)
def test_bad_headers_are_refused_with_a_code(mutate, code) -> None:  # type: ignore[no-untyped-def]
    head = P.encode_header(P.Op.GET, 1, b"", 0)
    with pytest.raises(P.ProtocolError) as e:
        P.parse_header(mutate(head), LIMITS)
    assert e.value.code is code
    assert e.value.fatal


def test_a_reply_op_is_not_a_request() -> None:
    with pytest.raises(P.ProtocolError, match="not expected"):
        P.parse_header(P.encode_header(P.Op.REPLY, 1, b"", 0), LIMITS)
    assert P.parse_header(P.encode_header(P.Op.REPLY, 1, b"", 0), LIMITS, reply=True).op is P.Op.REPLY


@given(ns=st.binary(min_size=16, max_size=16), hashes=hashes16, start=st.integers(0, 64), durable=st.booleans(),
       off=st.integers(0, 2**64 - 1))
def test_put_metadata_round_trips(ns: bytes, hashes: list[bytes], start: int, durable: bool, off: int) -> None:
    start = min(start, len(hashes))
    r = P.parse_put(P.encode_put(ns, hashes, start, durable), 64)
    assert (r.ns_id, r.hashes, r.start, r.durable) == (ns, hashes, start, durable)
    sums = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(len(hashes) - start)]
    r = P.parse_put(P.encode_put(ns, hashes, start, durable, off, sums), 64, shm=True)
    assert (r.hashes, r.staging_offset, r.checksums) == (hashes, off, tuple(sums))


@given(locs=st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), max_size=32),
       lease_id=st.integers(0, 2**64 - 1))
def test_lease_metadata_round_trips(locs: list[tuple[int, int]], lease_id: int) -> None:
    assert P.parse_lease(P.encode_lease(lease_id, locs)) == (lease_id, locs)


@given(ns=st.binary(min_size=16, max_size=16), runs=st.lists(st.integers(1, 8), max_size=8), bb=st.integers(1, 2**32 - 1))
def test_get_runs_metadata_round_trips(ns: bytes, runs: list[int], bb: int) -> None:
    hashes = [i.to_bytes(16, "little") for i in range(sum(runs))]
    req, got = P.parse_get_runs(P.encode_get_runs(ns, hashes, runs), 64)
    assert (req.ns_id, req.hashes, got) == (ns, hashes, runs)
    assert P.parse_runs_meta(P.encode_runs_meta(sum(runs), bb, runs)) == (sum(runs), bb, runs)


@pytest.mark.parametrize("runs", [[], [3], [2, 3], [0, 4], [1, 1, 1, 0, 1]])
def test_runs_that_do_not_cut_the_blocks_exactly_are_refused(runs: list[int]) -> None:
    hashes = [bytes(16)] * 4  # 4 blocks: each run at least 1, summing to 4
    with pytest.raises(P.ProtocolError, match="runs"):
        P.parse_get_runs(P.encode_get_runs(bytes(16), hashes, runs), 64)
    with pytest.raises(P.ProtocolError, match="runs"):
        P.parse_runs_meta(P.encode_runs_meta(4, 4096, runs))


@settings(max_examples=400)
@given(data=st.binary(max_size=200), reply=st.booleans())
def test_fuzz_header_parser_raises_only_protocol_errors(data: bytes, reply: bool) -> None:
    for chunk in (data, data[: P.HEADER_BYTES].ljust(P.HEADER_BYTES, b"\0"), P.MAGIC + bytes([P.VERSION]) + data[5:28]):
        try:
            hdr = P.parse_header(chunk, LIMITS, reply=reply)
        except P.ProtocolError as e:
            assert isinstance(e.code, P.ErrorCode)
        else:
            assert hdr.meta_len <= LIMITS.max_meta_bytes and hdr.payload_len <= LIMITS.max_payload_bytes


@settings(max_examples=400)
@given(meta=st.binary(max_size=400))
def test_fuzz_metadata_parsers_raise_only_protocol_errors(meta: bytes) -> None:
    parsers = [
        lambda m: P.parse_blocks(m, 16),
        lambda m: P.parse_put(m, 16),
        lambda m: P.parse_put(m, 16, shm=True),
        P.parse_lease,
        P.parse_u64,
        P.parse_data_meta,
        P.parse_error,
        P.parse_lookup,
        lambda m: P.parse_get_runs(m, 16),
        P.parse_runs_meta,
    ]
    for parse in parsers:
        try:
            parse(meta)
        except P.ProtocolError as e:  # anything else (struct.error, IndexError...) fails the test
            assert isinstance(e.code, P.ErrorCode)


@given(ns=st.binary(min_size=16, max_size=16), n=st.integers(0, 2**32 - 1), tail=st.binary(max_size=64))
def test_fuzz_a_block_count_that_lies_is_refused(ns: bytes, n: int, tail: bytes) -> None:
    meta = ns + n.to_bytes(4, "little") + tail
    try:
        r = P.parse_blocks(meta, 16)
    except P.ProtocolError as e:
        assert e.code in (P.ErrorCode.BAD_FRAME, P.ErrorCode.TOO_LARGE)
    else:
        assert len(r.hashes) == n and len(tail) == 16 * n


def test_put_flags_carry_durable_and_tokens_and_refuse_the_rest() -> None:
    ns, hashes = b"n" * 16, [bytes([i]) * 16 for i in range(3)]
    for durable in (False, True):
        for tokens in (False, True):
            r = P.parse_put(P.encode_put(ns, hashes, 1, durable, tokens=tokens), 64)
            assert (r.durable, r.tokens) == (durable, tokens)
            r = P.parse_put(P.encode_put(ns, hashes, 1, durable, 0, [7, 8], tokens=tokens), 64, shm=True)
            assert (r.durable, r.tokens, r.checksums) == (durable, tokens, (7, 8))
    meta = bytearray(P.encode_put(ns, hashes, 1, False))
    meta[16 + 8] = 4  # a flag no daemon knows
    with pytest.raises(P.ProtocolError, match="unknown put flags"):
        P.parse_put(bytes(meta), 64)


@given(tiers=st.lists(st.sampled_from(["dram", "nvme", "a-tier-with-a-long-name-on-some-disk"]), max_size=64),
       unavailable=st.lists(st.sampled_from(["s3", "object"]), max_size=2))
def test_lookup_reply_round_trips_in_two_bytes_a_block(tiers: list[str], unavailable: list[str]) -> None:
    meta = P.encode_lookup(len(tiers), tiers, unavailable)
    assert P.parse_lookup(meta) == (len(tiers), tuple(tiers), tuple(unavailable))
    # each name once, then two bytes a block: within the client's 64 + 16 * max_blocks limit
    names = {*tiers, *unavailable}
    assert len(meta) <= 80 + sum(len(x) + 3 for x in names) + 2 * len(tiers)


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=5), kids, max_size=4),
                     max_leaves=12)


@settings(max_examples=300)
@given(r=st.fixed_dictionaries({"names": _JSON, "num_blocks": _JSON, "tiers": _JSON, "unavailable": _JSON}) | _JSON)
def test_fuzz_lookup_replies_of_the_wrong_shape_raise_protocol_errors(r: object) -> None:
    import json

    try:
        P.parse_lookup(json.dumps(r).encode())
    except P.ProtocolError as e:
        assert e.code is P.ErrorCode.BAD_FRAME


def test_a_lookup_refusal_round_trips() -> None:
    assert P.parse_lookup(P.encode_refusal("LayoutMismatchError", 409, "another layout")) == P.Refusal(
        "LayoutMismatchError", 409, "another layout")
    with pytest.raises(P.ProtocolError):
        P.parse_lookup(b'{"kind": 3, "status": 409, "detail": "x"}')


@given(tiers=st.lists(st.sampled_from(["dram", "nvme"]), max_size=32), leased=st.integers(0, 32),
       offsets=st.lists(st.integers(0, 2**40), min_size=32, max_size=32))
def test_a_lookup_lease_reply_round_trips(tiers: list[str], leased: int, offsets: list[int]) -> None:
    """LOOKUP's reply, then a lease (none: id 0, no locations); a refusal has no lease."""
    lookup = P.encode_lookup(len(tiers), tiers, [])
    locs = [(o, 4096) for o in offsets[: min(leased, len(tiers))]]
    meta = P.encode_lookup_lease(lookup, 7 if locs else 0, locs)
    assert P.parse_lookup_lease(meta) == ((len(tiers), tuple(tiers), ()), 7 if locs else 0, locs)
    refusal = P.encode_refusal("LayoutMismatchError", 409, "another layout")
    assert P.parse_lookup_lease(P.encode_lookup_lease(refusal)) == (
        P.Refusal("LayoutMismatchError", 409, "another layout"), 0, [])


def test_a_cut_lookup_lease_reply_is_a_protocol_error() -> None:
    meta = P.encode_lookup_lease(P.encode_lookup(2, ["dram", "dram"], []), 3, [(0, 8), (8, 8)])
    for cut in (0, 3, 10, len(meta) - 1):
        with pytest.raises(P.ProtocolError):
            P.parse_lookup_lease(meta[:cut])
