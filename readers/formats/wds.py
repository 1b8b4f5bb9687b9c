"""Reader of the ``wds`` format: random access into WebDataset tar shards by byte offset.

Tar shards ``shard-000000.tar``... with members ``<key>.npy`` and ``<key>.cls``, plus
``wds_offsets.npy`` (count, 2) int64 giving each sample's shard number and the byte offset of its
raw pixels inside the tar (past the .npy header). Random access reads through one read-only mmap
per shard, opened on first use, for the checks; the pixels are copied out of it while the shard
is in the page cache, else read with preadv into the caller's buffer (readers/diskio.py), a
batch's reads on a thread pool.

Every sample served is checked where it lies: the member's name is ``<sample_key(i)>.npy`` and its
own .npy header gives the shape the manifest (fixed shapes) or ``index/shapes.npy`` says, so an
edited manifest or index, or a damaged offset, raises ShardFormatError naming the shard and the
sample instead of serving other bytes. A member's data starts on a 512-byte tar block and its
.npy header (128 bytes as written) is shorter than a block, so the header of the pixels at offset
``o`` starts at ``o - o % 512`` and the member's tar header 512 bytes before that.

Encoded (``--encoding jpeg``, EncodedWdsReader): ``wds_offsets.npy`` int64 (count, 3): shard,
byte offset and length of member ``<key>.jpg``, whose tar header (the 512 bytes before it) must
name the sample; from disk each sample's header and record are read by one preadv
(readers/formats/encoded.py).

The part layout (``--layout parts``): shards ``parts/pNNNNNNN.tar`` written by the nodes, keys
that are scan positions and a wider wds_offsets.npy (readers/formats/wds_parts.py).

In object storage each shard is one object (``Reader.pixel_files``: the manifest's shards); a
sample's tar header, .npy header and pixels are read by one ranged GET and checked the same way.
"""

from __future__ import annotations

import math
import mmap
import os
import tarfile

import numpy as np

from ..encoding import JPEG, JPEG_MEMBER, RAW
from ..manifest import WDS_OFFSETS, WDS_SHARD, ShardFormatError, load_npy, sample_key
from ..system import larger_than_ram
from .. import diskio
from .base import Reader, check_indices, check_out, check_value, flagged, npy_value, open_data, read_exact
from .encoded import EncodedReader
from .wds_parts import InParts

BLOCK = tarfile.BLOCKSIZE


def _member(i: int) -> bytes:
    """The NUL-terminated name field of sample i's .npy member (``sample_key(i)`` + ".npy")."""
    return b"%010d.npy\0" % i


_MEMBER_LEN = len(_member(0))
assert _member(0)[:-5].decode() == sample_key(0)  # the key rule of manifest.py, in bytes


class _Shards(Reader):
    """What the raw and the encoded reader share: the tar shards, each mapped on first use, and
    open for preadv (``_files``), with whether each is in the page cache (``_in_ram``; subclasses
    set these dicts and ``_fits`` in ``_open``)."""

    fmt = "wds"
    head_bytes = 0  # no header: each sample's tar header comes in its own GET (a HEAD per shard at open)
    _keys = None  # the part layout (wds_parts.py): int64 (count,) each sample's key; None: the key is i

    def data_paths(self):
        return sorted(self.root.glob("shard-*.tar"))

    def _shard_name(self, shard: int) -> str:
        """The file name (relative to OUT) of shard number ``shard`` as wds_offsets.npy numbers it."""
        return WDS_SHARD.format(shard)

    def _key(self, i: int) -> int:
        """The number in sample i's member names (``sample_key``): i itself in the single layout."""
        return i if self._keys is None else int(self._keys[i])

    def _keys_of(self, idx: np.ndarray) -> list[int]:
        """The keys of samples ``idx`` (int64 (B,), checked), as :meth:`_key`."""
        return idx.tolist() if self._keys is None else self._keys[idx].tolist()

    def _load_table(self, columns: int) -> np.ndarray:
        """wds_offsets.npy as a read-only map, (count, ``columns``) integers (raises ShardFormatError otherwise)."""
        return load_npy(self.root / WDS_OFFSETS, "i", (self.count, columns))

    @classmethod
    def pixel_files(cls, manifest):
        files = manifest.get("files") if isinstance(manifest.get("files"), dict) else {}
        return sorted(n for n in files if n.startswith("shard-") and n.endswith(".tar"))

    def _map(self, shard):
        m = self._maps.get(shard)
        if m is None:
            self.check_unchanged()  # shards open one by one, long after the others
            path = self.root / self._shard_name(shard)
            try:
                with open(path, "rb") as f:
                    m = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # only headers are read through it: no readahead
                    m.madvise(mmap.MADV_RANDOM)
            except (OSError, ValueError, OverflowError) as err:  # missing, or empty (mmap refuses 0 bytes)
                raise ShardFormatError(f"{path}: cannot map this shard ({err})") from None
        return m

    def _shards_in_ram(self, shards) -> bool:
        """Whether every shard in ``shards`` is mapped and in the page cache (diskio.InRam)."""
        for shard in shards:
            check = self._in_ram.get(shard)
            if check is None:
                m = self._maps.get(shard)
                if m is None:
                    return False
                check = self._in_ram[shard] = diskio.InRam(np.frombuffer(m, np.uint8), self._fits,
                                                             self._file(shard))
            if not check():
                return False
        return True

    def _file(self, shard) -> diskio.DataFile | None:
        """Shard ``shard`` open for preadv (an objects.ObjectFile in object storage), or None
        when it cannot be (the checks then say why)."""
        f = self._files.get(shard)
        if f is None and shard >= 0:
            try:
                if self.objects is None:
                    self._map(shard)  # checks the output is unchanged; raises for a missing shard
                f = self._files[shard] = open_data(self, None, self._shard_name(shard), fits=False)[0]
            except (OSError, ShardFormatError):
                return None
        return f

    def _no_shard(self, shard: int, i: int):
        """Raise ShardFormatError: sample i's shard cannot be opened (missing, or not listed)."""
        if self.objects is None and shard >= 0:
            self._map(shard)  # raises naming why it cannot be mapped
        raise ShardFormatError(f"{self.where(self._shard_name(max(shard, 0)))}: cannot open this shard"
                               f"{'' if shard >= 0 else f' (shard {shard})'}; {WDS_OFFSETS} puts sample {i} there")


class WdsReader(_Shards):
    _handles = ("_maps", "_files", "_offsets", "_header", "_in_ram", "_keys")

    def __init__(self, root, manifest):
        super().__init__(root, manifest)
        self._listed = manifest.get("files") or {}  # the shards the manifest lists, for record_problems

    def _shard_sizes(self) -> dict[int, int]:
        """{shard number: its size in bytes} of the shards the manifest lists."""
        return {int(n[6:12]): s for n, s in self._listed.items() if n.startswith("shard-")}

    def record_problems(self, index):
        """Offsets name shards the manifest lists, rise sample by sample and stay inside their shard."""
        at, need = np.asarray(self._offsets, np.int64), index.shapes.astype(np.int64).prod(axis=1)
        sizes = self._shard_sizes()
        shard_size = np.array([sizes.get(int(s), -1) for s in at[:, 0].clip(0, max(sizes, default=0))])
        missing = sorted({int(s) for s in at[:, 0]} - set(sizes))
        out = [f"{self.root / WDS_OFFSETS}: names {self._shard_name(missing[0])}, not in the manifest's files"
               ] if missing else []
        order = at[:, 0] * (1 << 40) + at[:, 1]
        if (np.diff(order) <= 0).any():
            out.append(f"{self.root / WDS_OFFSETS}: (shard, offset) pairs do not rise sample by sample")
        out.append(flagged((at[:, 1] < 0) | (at[:, 1] + need > shard_size),
                           f"{self.root / WDS_OFFSETS}: pixels beyond the end of their shard"))
        return [p for p in out if p]

    def _open(self):
        self._maps, self._files, self._header = {}, {}, None  # _header: the .npy header every fixed-shape member has
        self._offsets = self._load_table(2)
        self._in_ram, self._fits = {}, larger_than_ram(self.data_paths()) is None

    def _head(self, i: int, shard: int, start: int, offset: int):
        """``(shard's map or None, the shard's size, its bytes start - BLOCK .. offset)``: the
        member's tar header and .npy header before sample i's pixels at ``offset``, from the
        map, or in object storage by one ranged GET (b"" when ``start`` < BLOCK)."""
        if self.objects is not None:
            f = self._file(shard)
            if f is None:
                self._no_shard(shard, i)
            return None, f.size, bytes(f.pread(start - BLOCK, offset - start + BLOCK)) if start >= BLOCK else b""
        try:
            m = self._map(shard) if shard >= 0 else None
        except ShardFormatError as err:
            raise ShardFormatError(f"{err}; {WDS_OFFSETS} puts sample {i} there") from None
        f = self._file(shard) if m is not None else None
        if f is not None and os.fstat(f.fd).st_size < len(m):  # the map's tail would be SIGBUS now
            raise ShardFormatError(f"{self.root / self._shard_name(shard)}: sample {i}: the shard is shorter "
                                   f"than when it was opened ({len(m)} bytes; cut short or rewritten?)")
        if m is None:
            return None, 0, b""
        return m, len(m), m[start - BLOCK:offset] if start >= BLOCK else b""

    def _pixels_at(self, i: int, shard: int, offset: int, shape) -> mmap.mmap | None:
        """The shard map holding sample i's pixels at ``offset`` (None in object storage), after
        checking that the member there is sample i's .npy with ``shape`` and that its pixels lie
        inside the shard."""
        start = offset - offset % BLOCK
        m, size, head = self._head(i, shard, start, offset)
        key = self._key(i)
        name, path = _member(key), self.where(self._shard_name(max(shard, 0)))
        if size == 0 or start < BLOCK or head[:len(name)] != name:
            raise ShardFormatError(f"{path}: no member {sample_key(key)}.npy "
                                   f"before offset {offset}, where {WDS_OFFSETS} puts sample {i}")
        if self._header is not None and head[BLOCK:] == self._header:  # fixed shape: all alike
            got = self.shape
        else:
            data, got = npy_value(head, BLOCK, len(head), path, i)
            if data != len(head):
                raise ShardFormatError(f"{path}: sample {i}: its .npy header ends at byte {data + start - BLOCK}, "
                                       f"{WDS_OFFSETS} says its pixels start at {offset}")
            if self.shape is not None and got == self.shape:
                self._header = head[BLOCK:]
        if got != shape or offset + math.prod(shape) > size:
            check_value(path, i, tuple(shape), got, min(size - offset, math.prod(got)))
        return m

    def read_into(self, i, out):
        self._ensure_open()
        shard, offset = self._offsets[i].tolist()
        m = self._pixels_at(i, shard, offset, out.shape)
        if self._shards_in_ram((shard,)):
            out[...] = np.frombuffer(m, np.uint8, out.size, offset).reshape(out.shape)
        else:
            read_exact(self._file(shard), offset, out, i)

    def start_batch(self, indices, out):
        """Per sample one preadv of its member's tar header and .npy header (into a scratch row)
        and its pixels (into its row of ``out``), on diskio's pool; then, in the waiting thread,
        each member is checked to be the sample's .npy with the header every member of this
        shape has. A sample that fails (or whose shard is missing or short) goes through
        :meth:`_pixels_at`, which raises naming the shard and the sample."""
        check_out(out, len(indices), self.shape)
        self._ensure_open()
        if not len(indices):
            return diskio.Pending([])
        idx = check_indices(indices, self.count)
        at = self._offsets[idx].tolist()
        if self._header is None:  # the first batch: learn the header from its first sample
            self._pixels_at(int(idx[0]), *at[0], self.shape)
        flat = out.reshape(len(out), -1)
        size, header = flat.shape[1], self._header
        if self._shards_in_ram({s for s, _ in at}):
            self._copy_batch(idx, at, flat)
            return diskio.Pending([])
        heads = np.empty((len(idx), BLOCK + len(header or b"")), np.uint8)
        jobs, slow = [], []
        for k, (i, (shard, offset)) in enumerate(zip(idx.tolist(), at)):
            f, start = self._file(shard), offset - offset % BLOCK
            if f is None or header is None or start < BLOCK or offset - start != len(header) or offset + size > f.size:
                slow.append(k)
            else:
                jobs.append((f, start - BLOCK, [heads[k], flat[k]], i))

        def check():
            name = np.frombuffer(b"".join(_member(k) for k in self._keys_of(idx)), np.uint8).reshape(len(idx), -1)
            ok = (heads[:, :_MEMBER_LEN] == name).all(axis=1)
            if header is not None:
                ok &= (heads[:, BLOCK:] == np.frombuffer(header, np.uint8)).all(axis=1)
            for k in sorted(set(slow) | set(np.flatnonzero(~ok).tolist())):
                i, (shard, offset) = int(idx[k]), at[k]
                m = self._pixels_at(i, shard, offset, self.shape)
                if m is None:  # object storage: read by range
                    read_exact(self._file(shard), offset, flat[k], i)
                else:
                    flat[k] = np.frombuffer(m, np.uint8, size, offset)

        return diskio.submit(jobs, check)

    def _copy_batch(self, idx, at, flat):
        """In RAM: per sample a check of its member and a memcpy out of the shard maps. The check
        is :meth:`_pixels_at`'s, its common case inlined: a mapped shard, the member named for
        the sample, the header every member of this shape has."""
        size, maps = flat.shape[1], self._maps
        for k, (i, key, (shard, offset)) in enumerate(zip(idx.tolist(), self._keys_of(idx), at)):
            m, start = maps.get(shard), offset - offset % BLOCK
            if (m is None or self._header is None or start < BLOCK or offset + size > len(m)
                    or m[start:offset] != self._header or m[start - BLOCK:start - BLOCK + _MEMBER_LEN] != _member(key)):
                m = self._pixels_at(i, shard, offset, self.shape)
            flat[k] = np.frombuffer(m, np.uint8, size, offset)


class EncodedWdsReader(EncodedReader, _Shards):
    """Members ``<key>.jpg``, read as readers/formats/encoded.py says: in RAM out of the shard
    maps, from disk with one preadv per sample of the member's tar header and its record."""

    _handles = ("_maps", "_table", "_files", "_in_ram", "_keys")

    def _open(self):
        self._maps, self._files, self._in_ram = {}, {}, {}
        self._table = self._load_table(3)
        self._fits = larger_than_ram(self.data_paths()) is None

    def _in_ram_for(self, idx):
        return self._shards_in_ram({int(s) for s in self._table[idx, 0].tolist()})

    def _on_disk(self, i):
        shard, offset, n = self._table[i].tolist()
        f = self._file(shard)
        if f is None:
            if self.objects is None:
                self._sample_map(shard, i)  # raises, naming the shard and the sample
            self._no_shard(shard, i)
        path = f.path
        if offset < BLOCK or offset % BLOCK:
            self._no_member(i, path, offset)
        self._span(i, offset, offset + n, f.size, path)
        return f, offset - BLOCK, BLOCK + n, BLOCK

    def _check_head(self, i, head, path):
        name = self._name(i)
        if head[:len(name)].tobytes() != name:
            self._no_member(i, path, int(self._table[i, 1]))

    def _name(self, i: int) -> bytes:
        return f"{sample_key(self._key(i))}.{JPEG_MEMBER}".encode() + b"\0"

    def _no_member(self, i, path, offset):
        raise ShardFormatError(f"{path}: no member {sample_key(self._key(i))}.{JPEG_MEMBER} before offset {offset}, "
                               f"where {WDS_OFFSETS} puts sample {i}")

    def _sample_map(self, shard: int, i: int):
        try:
            return self._map(shard)
        except ShardFormatError as err:
            raise ShardFormatError(f"{err}; {WDS_OFFSETS} puts sample {i} there") from None

    def _locate(self, i):
        shard, offset, n = self._table[i].tolist()
        m = self._sample_map(shard, i)
        path = self.root / self._shard_name(shard)
        name = self._name(i)
        if offset < BLOCK or offset % BLOCK or m[offset - BLOCK:offset - BLOCK + len(name)] != name:
            self._no_member(i, path, offset)
        self._span(i, offset, offset + n, len(m), path)
        return np.frombuffer(m, np.uint8, n, offset), path

    def record_problems(self, index):
        t = np.asarray(self._table, np.int64)
        order = t[:, 0] * (1 << 40) + t[:, 1]
        out = []
        if (np.diff(order) <= 0).any():
            out.append(f"{self.root / WDS_OFFSETS}: (shard, offset) pairs do not rise sample by sample")
        if (t[:, 2] <= 0).any():
            out.append(f"{self.root / WDS_OFFSETS}: an empty record for sample {int(np.argmax(t[:, 2] <= 0))}")
        return out


class WdsPartsReader(InParts, WdsReader):
    """The part layout (readers/formats/wds_parts.py): raw pixels, one shape or many."""


class EncodedWdsPartsReader(InParts, EncodedWdsReader):
    """The part layout of ``--encoding jpeg``."""

    raw = False


READERS = {RAW: WdsReader, JPEG: EncodedWdsReader}  # what open_reader builds, by encoding
# the part layout (manifest "file_layout": "parts"), by (encoding, samples differ in shape)
PART_READERS = {(RAW, False): WdsPartsReader, (RAW, True): WdsPartsReader,
                (JPEG, False): EncodedWdsPartsReader, (JPEG, True): EncodedWdsPartsReader}
