"""What every format's reader of encoded records (``--encoding jpeg``) shares: finding each
sample's record, reading it, decoding it into ``out``.

Two ways to a record's bytes, chosen per batch as the raw readers choose (readers/diskio.py):
while the data is in the page cache (``diskio.InRam``: ``mincore`` says so, asked every few
seconds, and only for data that can fit) a record is decoded straight out of the memory map, in
the calling thread; otherwise a batch's records are read with ``preadv`` on diskio's pool, each
record's exact byte range (plus, for tar shards, the 512-byte member header before it, which
must name the sample) into one buffer, and each record is decoded by the pool thread that read
it as soon as it is read, so the batch's decodes run while its other reads are in flight. So
from disk only the records' own bytes are read (a page fault on the map would read ahead
around each ~20 KB record: 4.4x the bytes, or one 4 KiB page at a time where it is advised
random, as LMDB's is), and the decoders (which release the GIL) keep the cores busy.
"""

from __future__ import annotations

import numpy as np

from .. import diskio
from ..encoding import UndecodableRecord, decode_into, pick_decoder
from ..manifest import ShardFormatError
from .base import Reader, check_indices, check_out, open_data


class EncodedReader(Reader):
    """Base of the readers of encoded records. Subclasses implement ``_open``,
    ``_locate(i) -> (record as a uint8 array of the map, the file it is in)``,
    ``_on_disk(i) -> (diskio.DataFile, first byte, bytes, head)`` (the byte range to read for
    sample i, of which the first ``head`` bytes come before the record; its place checked
    against the format's own records), ``_in_ram_for(idx) -> bool`` and ``record_problems``;
    ``_check_head(i, head, path)`` checks the ``head`` bytes read before a record (tar: the
    member's name).

    A record that does not decode to the shape the manifest (or ``index/shapes.npy``) gives
    raises ShardFormatError naming the file and the sample; a data file that ends before a
    record's bytes raises diskio.CutShort (a ShardFormatError) naming the file and the sample.
    ``record(i)`` gives the stored bytes themselves (``verify`` and ``check_reads`` checksum them)."""

    decoder = "auto"  # simplejpeg when it imports, else pillow (readers/encoding.py)

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self.decoder = pick_decoder(self.decoder)

    def _locate(self, i: int):
        raise NotImplementedError

    def _on_disk(self, i: int):
        raise NotImplementedError

    def _in_ram_for(self, idx) -> bool:
        raise NotImplementedError

    def _check_head(self, i: int, head: np.ndarray, path) -> None:
        pass

    def _read_record(self, i: int) -> tuple[np.ndarray, object]:
        """Sample i's record read with one preadv (a new array), and its file's path."""
        file, start, n, head = self._on_disk(i)
        buf = np.empty(n, np.uint8)
        file.read(start, [buf], i)
        self._check_head(i, buf[:head], file.path)
        return buf[head:], file.path

    def record(self, i: int) -> np.ndarray:
        """Sample i's stored record (the JPEG bytes) as a uint8 array (read-only when it is a
        view of the map, in RAM; read from the file with preadv otherwise)."""
        self._ensure_open()
        if self._in_ram_for([i]):
            return self._locate(i)[0]
        return self._read_record(i)[0]

    def _decode(self, i: int, data, out: np.ndarray, where) -> None:
        try:
            decode_into(data, out, self.decoder)
        except UndecodableRecord as err:
            raise ShardFormatError(f"{where}: sample {i} cannot be decoded: {err}") from None

    def read_into(self, i, out):
        self._ensure_open()
        if self._in_ram_for([i]):
            data, where = self._locate(i)
        else:
            data, where = self._read_record(i)
        self._decode(i, data, out, where)

    def start_batch(self, indices, out):
        """Decode samples ``indices`` into ``out`` (as Reader.start_batch). In RAM: now, out of
        the map, in the calling thread (make_loader's threads decode batches in parallel). From
        disk: the records' byte ranges read on diskio's pool into one buffer (adjacent ones by
        one preadv), each decoded by the thread that read it; ``.wait()`` raises the first
        error (a failed or short read, a record that does not decode), naming file and sample."""
        check_out(out, len(indices), self.shape)
        self._ensure_open()
        idx = check_indices(indices, self.count).tolist()
        if self._in_ram_for(idx):
            for k, i in enumerate(idx):
                data, where = self._locate(i)
                self._decode(i, data, out[k], where)
            return diskio.Pending([])
        spans = [self._on_disk(i) for i in idx]
        starts = [0]  # where each sample's bytes go in the batch's buffer
        for _, _, n, _ in spans:
            starts.append(starts[-1] + n)
        buf = np.empty(starts[-1], np.uint8)
        jobs = [(file, start, [buf[at:at + n]], i) for i, (file, start, n, _), at in zip(idx, spans, starts)]

        def decode(k: int) -> None:
            i, (file, _, n, head), at = idx[k], spans[k], starts[k]
            self._check_head(i, buf[at:at + head], file.path)
            self._decode(i, buf[at + head:at + n], out[k], file.path)

        return diskio.submit(jobs, each=decode)

    def _span(self, i: int, start: int, end: int, size: int, where):
        if not 0 <= start < end <= size:
            raise ShardFormatError(f"{where}: sample {i} has bytes {start}..{end}, outside the {size} stored")


class FlatReader(EncodedReader):
    """npy and hdf5: one flat uint8 array of the records (``_images``, a map of ``data_file``
    from byte ``_base`` on), ``_offsets`` (count + 1,) their byte ranges in it."""

    _handles = ("_images", "_offsets", "_file", "_in_ram")
    data_file = ""
    _base = 0
    _offsets_at = None  # hdf5: the byte of the data file where the offsets lie (after the records)

    def data_paths(self):
        return [self.root / self.data_file]

    def _check_flat(self, base: int):
        """Check the records and offsets against the manifest, then open the data file for
        preadv; the records start at byte ``base`` of it."""
        path = self.root / self.data_file
        if (self._images.ndim != 1 or self._images.dtype != np.uint8 or self._offsets.shape != (self.count + 1,)
                or self._offsets.dtype.kind not in "iu" or int(self._offsets[-1]) != len(self._images)):
            raise ShardFormatError(f"{path}: records {self._images.shape} {self._images.dtype} and offsets "
                                   f"{self._offsets.shape}, the manifest says {self.count} samples")
        self._file, self._in_ram = open_data(self, self._images)
        self._base = int(base)

    def _range(self, i) -> tuple[int, int]:
        if self._offsets_at is not None and self._in_ram.cut:
            # the offsets' map may now lie past the file's end (SIGBUS): read them with preadv,
            # which raises naming the file and the sample where they are gone
            pair = np.empty(2, self._offsets.dtype)
            self._file.read(self._offsets_at + i * pair.itemsize, [pair], i)
            a, b = int(pair[0]), int(pair[1])
        else:
            a, b = int(self._offsets[i]), int(self._offsets[i + 1])
        self._span(i, a, b, len(self._images), self.where(self.data_file))
        return a, b

    def _locate(self, i):
        a, b = self._range(i)
        return self._images[a:b], self.root / self.data_file

    def _on_disk(self, i):
        a, b = self._range(i)
        return self._file, self._base + a, b - a, 0

    def _in_ram_for(self, idx):
        return self._in_ram()

    def record_problems(self, index):
        off = np.asarray(self._offsets, np.int64)
        if off[0] != 0 or (np.diff(off) <= 0).any():
            return [f"{self.root / self.data_file}: record offsets do not rise from 0 (an empty or reversed record)"]
        return []
