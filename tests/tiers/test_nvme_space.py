"""The NVMe tier refuses a capacity the disk cannot hold, before preallocating, and leaves no
partial preallocation behind when the disk fills during one."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from kvstore.errors import ConfigError, TierIOError
from tiers import _direct
from tiers.nvme import NvmeConfig, NvmeTier

MiB = 1 << 20


def _free(path: Path) -> int:
    vfs = os.statvfs(path)
    return vfs.f_bavail * vfs.f_frsize


def test_capacity_past_free_space_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    slab = 64 * MiB
    asked = (_free(tmp_path) // slab + 16) * slab  # a typo's worth more than the disk has
    with pytest.raises(ConfigError) as err:
        NvmeTier("nvme", NvmeConfig(capacity_bytes=asked, slab_bytes=slab), root=tmp_path)
    msg = str(err.value)
    assert f"({asked} bytes)" in msg and "is free there" in msg and "lower capacity_bytes" in msg
    assert not (tmp_path / "tiers" / "nvme" / "data.slab").exists()


def test_a_failed_preallocation_is_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full_disk(self: _direct.DirectFile, size: int) -> None:
        os.posix_fallocate(self.fd, 0, 4096)  # the part allocated before the disk filled
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_direct.DirectFile, "resize", full_disk)
    with pytest.raises(TierIOError, match="the disk is full"):
        NvmeTier("nvme", NvmeConfig(capacity_bytes=4 * MiB, slab_bytes=MiB), root=tmp_path)
    assert not (tmp_path / "tiers" / "nvme" / "data.slab").exists()


def test_a_grown_file_goes_back_to_its_old_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    NvmeTier("nvme", NvmeConfig(capacity_bytes=2 * MiB, slab_bytes=MiB), root=tmp_path).close()
    data = tmp_path / "tiers" / "nvme" / "data.slab"
    assert data.stat().st_size == 2 * MiB
    real = _direct.DirectFile.resize

    def full_disk(self: _direct.DirectFile, size: int) -> None:
        os.ftruncate(self.fd, size)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_direct.DirectFile, "resize", full_disk)
    with pytest.raises(TierIOError):
        NvmeTier("nvme", NvmeConfig(capacity_bytes=8 * MiB, slab_bytes=MiB), root=tmp_path)
    assert data.stat().st_size == 2 * MiB
    monkeypatch.setattr(_direct.DirectFile, "resize", real)
    NvmeTier("nvme", NvmeConfig(capacity_bytes=2 * MiB, slab_bytes=MiB), root=tmp_path).close()
