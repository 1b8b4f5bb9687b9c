"""Writer of the ``wds`` format: WebDataset tar shards, the mirror of readers/formats/wds.py.

Shards ``shard-000000.tar``, ... each holding ``<key>.npy`` (the uint8 HWC array in .npy
format) and ``<key>.cls`` (the label as ASCII) per sample, in order, so that stock
``webdataset.WebDataset(urls).decode()`` reads them. A new shard starts before one would exceed
``shard_size`` bytes. ``wds_offsets.npy`` records (shard, byte
offset of the pixels) per sample for random access. Members carry mtime 0 and no owner, so the
tars are byte-identical for identical content. Variable shapes need nothing more: each
member's .npy header carries its sample's shape.

Encoded (EncodedWdsWriter, ``--encoding jpeg``): members ``<key>.jpg`` and ``<key>.cls``, so
stock ``webdataset ... .decode("rgb8")`` reads them; ``wds_offsets.npy`` int64 (count, 3):
shard, byte offset and length of each JPEG.

The part layout (WdsPartsWriter, ``--layout parts``, packer/parts.py): ``parts/pNNNNNNN.tar``
each written by the node that decoded it, keys the samples' scan positions, and the driver's
``wds_offsets.npy`` (count, 4) (writers/wds_parts.py).
"""

from __future__ import annotations

import os
import tarfile

import numpy as np

from ...readers.encoding import JPEG, JPEG_MEMBER, RAW
from ...readers.manifest import WDS_OFFSETS, WDS_SHARD, sample_key

from .base import Writer, drop_cache, npy_header, reserved_memmap, save_synced

DEFAULT_SHARD_SIZE = 1 << 30
BLOCK, RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
END = b"\0" * (2 * BLOCK)  # end-of-archive marker, as tarfile.TarFile.close writes it


def _member_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file member (tarfile builds it)."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, 0, 0o644
    return info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")


class WdsWriter(Writer):
    """Members are written straight to the shard file: tarfile's ``addfile`` would copy each
    196 KB sample three times (tobytes, concatenation, 16 KB chunks through a BytesIO)."""

    @classmethod
    def stored_bytes(cls, n, fixed, estimate):
        """The shards: per sample a 512-byte header and the data padded to 512-byte blocks for each
        of its two members (``.npy`` with its 128-byte header, or ``.jpg``; ``.cls``: one block),
        the offsets table (16 or 24 bytes), and each shard's end blocks and last record (10 KB)."""
        data = estimate.sample_bytes + (0 if cls is EncodedWdsWriter else 128)
        padded = -(-data // BLOCK) * BLOCK if fixed and cls is not EncodedWdsWriter else data + BLOCK - 1
        shards = 1 + int(n * (padded + 3 * BLOCK)) // DEFAULT_SHARD_SIZE
        return int(n * (padded + 3 * BLOCK + 24) + shards * (2 * BLOCK + RECORD))

    @classmethod
    def scratch_bytes(cls, n, fixed, estimate):
        """The (shard, offset) table of every sample, 16 bytes each, whatever the shapes."""
        return 16 * n

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        self.shard_size = int(options.get("shard_size") or DEFAULT_SHARD_SIZE)
        partial = self.scratch / (WDS_OFFSETS + ".partial")
        self.offsets = (np.lib.format.open_memmap(partial, mode="r+", dtype=np.int64, shape=(n, 2))
                        if partial.exists() else reserved_memmap(partial, np.int64, (n, 2)))
        self.header = npy_header(self.shape) if self.shape else None
        self.shard, self.file, self.offset, self.in_shard = -1, None, 0, 0

    def _open_shard(self, shard: int, offset: int = 0):
        self._close_shard()
        path = self.tmp / WDS_SHARD.format(shard)
        self.file = open(path, "r+b" if offset else "wb")
        self.file.truncate(offset)
        self.file.seek(offset)
        self.shard, self.offset, self.in_shard = shard, offset, int(offset > 0)

    def _close_shard(self):
        if self.file is not None:
            end = self.offset + len(END)
            self.file.write(END + b"\0" * (-end % RECORD))  # tarfile pads to whole records
            self.file.flush()
            os.fsync(self.file.fileno())  # a finished shard is never touched again: make it durable
            drop_cache(self.file.fileno())
            self.file.close()
            self.file = None

    def _add(self, name: str, *parts) -> int:
        """Append one member made of ``parts`` (buffers); returns the offset of its data."""
        size = sum(memoryview(b).nbytes for b in parts)
        head = _member_header(name, size)
        self.file.write(head)
        for b in parts:
            self.file.write(b)
        self.file.write(b"\0" * (-size % BLOCK))
        data_at = self.offset + len(head)
        self.offset = data_at + size + (-size % BLOCK)
        return data_at

    def write(self, index, pixels, label):
        key = sample_key(index)
        header = self.header or npy_header(pixels.shape)
        size = len(header) + pixels.nbytes
        need = 3 * BLOCK + size + 1024 + RECORD  # headers, padding, end blocks
        if self.file is None or (self.in_shard and self.offset + need > self.shard_size):
            self._open_shard(self.shard + 1)
        start = self._add(f"{key}.npy", header, np.ascontiguousarray(pixels).data)
        self._add(f"{key}.cls", str(int(label)).encode())
        self.offsets[index] = (self.shard, start + len(header))
        self.in_shard += 1

    def flush(self):
        if self.file is not None:
            self.file.flush()

    def sync(self):
        if self.file is not None:
            os.fsync(self.file.fileno())
        self.offsets.flush()

    def release(self, done):
        if self.file is not None:
            drop_cache(self.file.fileno())

    def state(self):
        return {"shard": self.shard, "offset": self.offset if self.file is not None else 0}

    def resume(self, state):
        shard, offset = int(state.get("shard", -1)), int(state.get("offset", 0))
        for name in os.listdir(self.tmp):  # shards begun after the checkpoint
            if name.startswith("shard-") and int(name[6:12]) > shard:
                os.remove(self.tmp / name)
        if shard >= 0:
            self._open_shard(shard, offset)

    def finished_files(self, state):
        """The shards before the checkpoint's open one: closed, and kept as they are by a resume."""
        return [WDS_SHARD.format(i) for i in range(int(state.get("shard", -1)))]

    def finish(self, kept):
        self._close_shard()
        count = len(kept)
        save_synced(self.tmp / WDS_OFFSETS, np.asarray(self.offsets[:count]))
        del self.offsets  # its file stays until the commit: a failed finish is redone from it
        files = {name: (self.tmp / name).stat().st_size for name in sorted(os.listdir(self.tmp))
                 if name.startswith("shard-") or name == WDS_OFFSETS}
        return {"files": files, "shards": self.shard + 1}

    def close(self):
        """Close the open shard as it is (finish() ends shards properly; after a failure the
        resume cuts it back to the checkpoint, so nothing more is written)."""
        if self.file is not None:
            file, self.file = self.file, None
            file.close()


class EncodedWdsWriter(WdsWriter):
    """Members ``<key>.jpg`` + ``<key>.cls``; each record's length is kept beside its offset."""

    def __init__(self, tmp, n, shape, labels, options):
        super().__init__(tmp, n, shape, labels, options)
        part = self.scratch / "wds_lengths.partial.npy"
        self.lengths = (np.lib.format.open_memmap(part, mode="r+", dtype=np.int64, shape=(n,))
                        if part.exists() else reserved_memmap(part, np.int64, (n,)))

    def write(self, index, record, label):
        key, data = sample_key(index), np.ascontiguousarray(record, np.uint8)
        need = 3 * BLOCK + data.nbytes + 1024 + RECORD  # headers, padding, end blocks
        if self.file is None or (self.in_shard and self.offset + need > self.shard_size):
            self._open_shard(self.shard + 1)
        start = self._add(f"{key}.{JPEG_MEMBER}", data.data)
        self._add(f"{key}.cls", str(int(label)).encode())
        self.offsets[index] = (self.shard, start)
        self.lengths[index] = data.nbytes
        self.in_shard += 1

    def sync(self):
        super().sync()
        self.lengths.flush()

    def finish(self, kept):
        count = len(kept)
        table = np.concatenate([np.asarray(self.offsets[:count]), np.asarray(self.lengths[:count])[:, None]], axis=1)
        written = super().finish(kept)  # writes the (count, 2) table: replaced by the (count, 3) one
        save_synced(self.tmp / WDS_OFFSETS, table)
        del self.lengths
        written["files"][WDS_OFFSETS] = (self.tmp / WDS_OFFSETS).stat().st_size
        return written


# What open_writer builds, by (encoding, samples differ in shape): members carry their shapes.
WRITERS = {(RAW, False): WdsWriter, (RAW, True): WdsWriter,
           (JPEG, False): EncodedWdsWriter, (JPEG, True): EncodedWdsWriter}

from .wds_parts import EncodedWdsPartsWriter, WdsPartsWriter  # noqa: E402 (it imports this module's tar helpers lazily)

PART_WRITERS = {(RAW, False): WdsPartsWriter, (RAW, True): WdsPartsWriter,  # --layout parts (wds_parts.py)
                (JPEG, False): EncodedWdsPartsWriter, (JPEG, True): EncodedWdsPartsWriter}
