"""wds's part layout (``--layout parts``, packer/parts.py): each part one tar shard, written by its node.

An output's files::

    parts/p0000000.tar          the kept samples of scan positions [0, P), in scan order
    parts/p0000000.index.npy    int64 (count_0, 3): each sample's data offset, length, key
    parts/p0000001.tar ...      (P: files per part, packer.parts.part_files: ~1 GiB or --shard-size)
    wds_offsets.npy             int64 (count, 4): part, offset, length, key (the driver's, last)
    index/ manifest.json ...    as every output

A part's tar is what the single layout's shards are (members ``<key>.npy`` + ``<key>.cls``, or
``<key>.jpg`` + ``<key>.cls`` with ``--encoding jpeg``, mtime 0, no owner, ended and padded as
tarfile does), with one difference: a sample's key is ``sample_key(scan position)``, its place
in the listing, which its node knows; its place in the output depends on the files skipped in
earlier parts, which no node knows. So a part's bytes follow from its own files alone, and a
local K=1, K=2, units or Ray run writes the same tars. Stock ``webdataset.WebDataset(
"OUT/parts/p{0000000..0002799}.tar")`` and ``tar tf`` read them.

A node (TarPart) writes ``<part>.<attempt>.tmp``, digesting each byte as it writes it (no
re-read), fsyncs it, writes the part's table (parts_rows.save_table) and renames both. The
driver (WdsPartsWriter.own_files) reads the parts' tables at the commit (24 bytes a sample,
O(parts) opens) and writes ``wds_offsets.npy``, what readers/formats/wds.py reads.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import numpy as np
import xxhash

from ...readers.encoding import JPEG_MEMBER
from ...readers.manifest import PARTS_DIR, WDS_OFFSETS, sample_key

from ..parts import PartsWriter
from ..parts_rows import drop_attempt, save_table
from .base import Writer, npy_header, save_synced

BLOCK, RECORD = tarfile.BLOCKSIZE, tarfile.RECORDSIZE
INDEX_SUFFIX = ".index.npy"  # a part's table beside it: p0000012.tar -> p0000012.index.npy


class TarPart:
    """One part's tar shard (the module docstring); ``encoded``: members are JPEG records."""

    def __init__(self, path: Path, attempt: str, shape, encoded: bool):
        from .wds import END, _member_header  # (wds.py imports this module for its PART_WRITERS)
        self.member_header, self.end = _member_header, END
        self.path, self.attempt, self.encoded = Path(path), attempt, encoded
        self.tmp = f"{path}.{attempt}.tmp"
        self.header = npy_header(shape) if shape and not encoded else None
        self.f = open(self.tmp, "wb")
        self.digest, self.at, self.count = xxhash.xxh3_128(), 0, 0
        self.table: list[tuple[int, int, int]] = []

    def _write(self, *bufs) -> None:
        for b in bufs:
            self.f.write(b)
            self.digest.update(b)
            self.at += memoryview(b).nbytes

    def _add(self, name: str, *bufs) -> int:
        """Append one member made of ``bufs``; the byte its data starts at."""
        size = sum(memoryview(b).nbytes for b in bufs)
        self._write(self.member_header(name, size))
        data = self.at
        self._write(*bufs, b"\0" * (-size % BLOCK))
        return data

    def add(self, stored: np.ndarray, index: int, label: int) -> None:
        """Append sample ``stored`` (HWC pixels, or a JPEG record) of scan position ``index``
        and class ``label``: its two members, named ``sample_key(index)``."""
        key, data = sample_key(index), np.ascontiguousarray(stored)
        if self.encoded:
            at = self._add(f"{key}.{JPEG_MEMBER}", data.data)
        else:
            head = self.header or npy_header(stored.shape)
            at = self._add(f"{key}.npy", head, data.data) + len(head)
        self._add(f"{key}.cls", str(int(label)).encode())
        self.table.append((at, data.nbytes, index))
        self.count += 1

    def close(self) -> dict:
        end = self.at + len(self.end)
        self._write(self.end, b"\0" * (-end % RECORD))  # tarfile pads to whole records
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        table = np.array(self.table, np.int64).reshape(-1, 3)
        rows = save_table(self.path.with_name(self.path.name[:-len(".tar")] + INDEX_SUFFIX), self.attempt, table)
        os.replace(self.tmp, self.path)
        return {"name": f"{PARTS_DIR}/{self.path.name}", "count": self.count, "bytes": self.at,
                "xxh3": self.digest.hexdigest(), "rows": rows}

    def abort(self) -> None:
        """After a failure: close and remove this attempt's file (a retry writes its own)."""
        drop_attempt(self.f, self.tmp)


class WdsPartsWriter(PartsWriter, Writer):
    """The part layout of raw pixels (one shape or many: each member's .npy header has its own):
    parts ``parts/pNNNNNNN.tar`` written by their nodes; the driver writes ``wds_offsets.npy``."""

    part_suffix, fmt = ".tar", "wds"
    encoded = False

    @classmethod
    def stored_bytes(cls, n, fixed, estimate):
        """The single layout's shards (writers/wds.py) and 40 bytes a sample more: the parts'
        tables (24) and the key and length in wds_offsets.npy (16)."""
        from .wds import EncodedWdsWriter, WdsWriter
        return (EncodedWdsWriter if cls.encoded else WdsWriter).stored_bytes(n, fixed, estimate) + 40 * n

    @classmethod
    def part_file(cls, path, attempt, shape):
        return TarPart(path, attempt, shape, cls.encoded)

    def own_files(self, kept):
        """wds_offsets.npy from the parts' tables (int64 (count, 4): part, offset, length, key),
        after checking their keys are the kept files' scan positions."""
        tables = [np.zeros((0, 4), np.int64)]
        for g in sorted(self.parts):
            t = np.load(self.tmp / self.parts[g]["rows"]["name"])
            if t.shape != (self.parts[g]["count"], 3):
                raise RuntimeError(f"{self.tmp / self.parts[g]['rows']['name']}: {t.shape}, its part holds "
                                   f"{self.parts[g]['count']} samples")
            tables.append(np.concatenate([np.full((len(t), 1), g, np.int64), t], axis=1))
        table = np.concatenate(tables)
        if not np.array_equal(table[:, 3], np.asarray(kept, np.int64)):
            raise RuntimeError(f"{self.parts_dir}: the parts' keys are not the scan positions of the files kept")
        save_synced(self.tmp / WDS_OFFSETS, table)
        return {WDS_OFFSETS: (self.tmp / WDS_OFFSETS).stat().st_size}


class EncodedWdsPartsWriter(WdsPartsWriter):
    """``--encoding jpeg``: members ``<key>.jpg`` + ``<key>.cls``."""

    encoded = True
