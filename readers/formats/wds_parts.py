"""What the wds readers do differently for the part layout (``--layout parts``, readers/layout.py).

A wds part-layout output keeps its pixels in tar shards ``parts/pNNNNNNN.tar``, one a part,
each written by the node that decoded it (packer/writers/wds_parts.py), listed in order in the
manifest's "parts". Members are named by the sample's *scan position* (its place in the
listing, what a node knows), not by its place in the output (which depends on the files
skipped in earlier parts): ``<sample_key(scan position)>.npy`` (or ``.jpg``) and ``.cls``. So
the keys rise but skip the skipped files' numbers.

``wds_offsets.npy`` (written by the driver from the parts' own tables) is int64 (count, 4):
part number, byte offset and length of the sample's data (raw: its pixels past the .npy
header; JPEG: the record), and its key. Each part's own table ``parts/pNNNNNNN.index.npy`` int64
(count_g, 3) (offset, length, key) sits beside it (the manifest's "rows"), for a user who
takes some parts only; the readers do not open it.

Every check and read path of readers/formats/wds.py holds as it is; only the shard a number
names, the key a sample's members carry and the table's width differ (:class:`InParts`).
"""

from __future__ import annotations

import numpy as np

from ..manifest import WDS_OFFSETS, load_npy

TABLE_COLUMNS = 4  # wds_offsets.npy of the part layout: part, offset, length, key


class InParts:
    """Mixed in before WdsReader or EncodedWdsReader: shards are the manifest's parts, keys are
    column 3 of wds_offsets.npy. ``raw``: raw pixels (a length is then its shape's bytes)."""

    raw = True

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.names = [p["name"] for p in manifest["parts"]]
        self.counts = np.array([p["count"] for p in manifest["parts"]], np.int64)
        files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
        self._part_sizes = {g: files.get(name, -1) for g, name in enumerate(self.names)}

    def data_paths(self):
        return [self.root / name for name in self.names]

    @classmethod
    def pixel_files(cls, manifest):
        return [p["name"] for p in manifest.get("parts", ())]

    def _shard_name(self, shard: int) -> str:
        return self.names[shard] if 0 <= shard < len(self.names) else f"part {shard} (of {len(self.names)})"

    def _shard_sizes(self) -> dict[int, int]:
        return self._part_sizes

    def _load_table(self, columns: int) -> np.ndarray:
        table = load_npy(self.root / WDS_OFFSETS, "i", (self.count, TABLE_COLUMNS))
        self._keys = table[:, 3]
        return table[:, :columns]

    def record_problems(self, index):
        """The format's checks, and: each sample in the part the manifest's counts put it in, the
        keys rising (scan positions, each once), a raw sample's length what its shape needs."""
        out = super().record_problems(index)
        where = self.root / WDS_OFFSETS
        table = np.asarray(load_npy(where, "i", (self.count, TABLE_COLUMNS)), np.int64)
        if not np.array_equal(table[:, 0], np.repeat(np.arange(len(self.names)), self.counts)):
            out.append(f"{where}: part numbers that do not follow the manifest's parts and their counts")
        if (np.diff(table[:, 3]) <= 0).any() or (table[:, 3] < 0).any():
            out.append(f"{where}: keys (scan positions) that do not rise sample by sample")
        if self.raw and (table[:, 2] != index.shapes.astype(np.int64).prod(axis=1)).any():
            out.append(f"{where}: a length of another size than its sample's shape needs")
        return out
