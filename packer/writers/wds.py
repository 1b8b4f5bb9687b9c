"""Writer of the ``wds`` format: WebDataset tar shards ``shard-000000.tar``, ... each holding
``<key>.npy`` (the uint8 HWC array in .npy format) and ``<key>.cls`` (the label as ASCII) per
sample, in order, so that stock ``webdataset.WebDataset(urls).decode()`` reads them. A new shard
starts before one would exceed ``shard_size`` bytes. ``wds_offsets.npy`` records (shard, byte
offset of the pixels) per sample for random access. Members carry mtime 0 and no owner, so the
tars are byte-identical for identical content. Variable shapes need nothing more: each
member's .npy header carries its sample's shape.
"""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np

from readers.manifest import WDS_OFFSETS, WDS_SHARD, sample_key

from .base import Writer, npy_header

DEFAULT_SHARD_SIZE = 1 << 30


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    return info


class WdsWriter(Writer):
    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.shard_size = int(options.get("shard_size") or DEFAULT_SHARD_SIZE)
        self.offsets = np.lib.format.open_memmap(self.tmp / (WDS_OFFSETS + ".partial"),
                                                 mode="r+" if (self.tmp / (WDS_OFFSETS + ".partial")).exists() else "w+",
                                                 dtype=np.int64, shape=(n, 2))
        self.header = npy_header(self.shape) if self.shape else None
        self.shard, self.file, self.tar, self.in_shard = -1, None, None, 0

    def _open_shard(self, shard: int, offset: int = 0):
        self._close_shard()
        path = self.tmp / WDS_SHARD.format(shard)
        self.file = open(path, "r+b" if offset else "wb")
        self.file.truncate(offset)
        self.file.seek(offset)
        self.tar = tarfile.open(fileobj=self.file, mode="w", format=tarfile.USTAR_FORMAT)
        self.shard, self.in_shard = shard, int(offset > 0)

    def _close_shard(self):
        if self.tar is not None:
            self.tar.close()  # end-of-archive blocks
            self.file.close()
            self.tar = self.file = None

    def write(self, index, pixels, label):
        key = sample_key(index)
        header = self.header or npy_header(pixels.shape)
        size = len(header) + pixels.nbytes
        cls = str(int(label)).encode()
        need = 3 * 512 + size + 1024 + 10240  # headers, padding, end blocks
        if self.tar is None or (self.in_shard and self.tar.offset + need > self.shard_size):
            self._open_shard(self.shard + 1)
        info = _info(f"{key}.npy", size)
        start = self.tar.offset + len(info.tobuf(self.tar.format, self.tar.encoding, self.tar.errors))
        self.tar.addfile(info, io.BytesIO(header + pixels.tobytes()))
        self.tar.addfile(_info(f"{key}.cls", len(cls)), io.BytesIO(cls))
        self.offsets[index] = (self.shard, start + len(header))
        self.in_shard += 1

    def flush(self):
        if self.tar is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
        self.offsets.flush()

    def state(self):
        return {"shard": self.shard, "offset": self.tar.offset if self.tar is not None else 0}

    def resume(self, state):
        shard, offset = int(state.get("shard", -1)), int(state.get("offset", 0))
        for name in os.listdir(self.tmp):  # shards begun after the checkpoint
            if name.startswith("shard-") and int(name[6:12]) > shard:
                os.remove(self.tmp / name)
        if shard >= 0:
            self._open_shard(shard, offset)

    def finish(self, kept):
        self._close_shard()
        count = len(kept)
        np.save(self.tmp / WDS_OFFSETS, np.asarray(self.offsets[:count]))
        del self.offsets
        os.remove(self.tmp / (WDS_OFFSETS + ".partial"))
        files = {name: (self.tmp / name).stat().st_size for name in sorted(os.listdir(self.tmp))
                 if name.startswith("shard-") or name == WDS_OFFSETS}
        return {"files": files, "shards": self.shard + 1}

    def close(self):
        self._close_shard()
