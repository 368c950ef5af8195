"""The object-store tier: content-addressed, self-describing objects on any fsspec filesystem.

``file://`` (the embedded default, under the tier's directory) works out of the box; ``s3://``
(AWS S3, Ceph RGW, MinIO: s3.py) and other URLs work wherever fsspec has a backend. An
object is found from the block hash alone, so any node sharing the bucket finds any block::

    {base}/blocks/{hash[:2]}/{hash}.kvb      the block: header + payload (format.py)
    {base}/touch/{hash[:2]}/{hash}.kvt       a refreshed expiry time, when one was written

and carries everything a cold restart needs (namespace descriptor, parent, depth, expiry,
checksums), so the index can be rebuilt by listing the bucket. Every read verifies the header
checksum, the object's length and the payload checksum: a damaged object is a miss.

Remote stores (anything but ``file://``) get batched, concurrent requests, a circuit breaker and a
bounded write queue (remote.py): while the store is unreachable the tier is *unavailable*
(no request, no timeout), non-durable writes wait in the queue or are dropped with a counter, and
the tier comes back by itself once a trial request is answered.

Expiry: a background sweeper deletes objects whose expiry passed (header, or a later touch
written by :meth:`ObjectTier.update_expiry`), with a work cap per pass. It sees every object in
the bucket, including those of other nodes, which no store's index holds (expiry.py).

Modules: ``config.py`` (ObjectConfig), ``format.py`` (header, codec, touch records: bytes only),
``tier.py`` (ObjectTier: maps, capacity, listing, probes; it decides), ``expiry.py`` (touches,
sweeper), and the bytes behind one small interface, ``blobs.py`` (BlobStore): ``local.py``
(LocalBlobs: plain files) and ``remote.py`` (RemoteBlobs over Remote, Breaker, WriteQueue);
S3 specifics in ``s3.py``. How to use it with S3, Ceph RGW or MinIO:
``docs/object-store.md``.
"""

from tiers.object.config import ObjectConfig
from tiers.object.format import (
    FORMAT_VERSION,
    MAGIC,
    MIN_HEADER,
    Header,
    pack_header,
    unpack_header,
)
from tiers.object.tier import ObjectTier

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "MIN_HEADER",
    "Header",
    "ObjectConfig",
    "ObjectTier",
    "pack_header",
    "unpack_header",
]
