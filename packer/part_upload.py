"""A part uploaded by the task that wrote it: ``--layout parts`` with ``-o s3://bucket/prefix/OUT``.

Each node (parts.run_part, on a Ray task or a local unit process) writes its part into the
staged output's ``parts/`` as for a local OUT (tmp, fsync, digest, rename), then, before its
unit record (the part's commit marker), puts the part's files under the output's URL with the
keys they have in the output (``parts/pNNNNNNN.<ext>`` and its row table; multipart above
8 MiB: multipart.put_file) and removes its local copy of the part file, so a node's disk holds
only the parts in flight. The row table (8-24 bytes a sample) stays beside it: the driver reads
the tables at the commit (wds_offsets.npy, HDF5's images.h5), and HDF5 keeps its part's
columns in ``run/units/pNNNNNNN.h5.columns.npz`` for that (write_vds; removed with run/).
The record lists what was put, ``"uploaded"``: {name: ETag}; a ``--resume`` takes a unit whose
record is there as done (its part is not put again), and the driver's commit (upload.py) checks
every uploaded file against one LIST of the URL (size, ETag) before it puts the manifest last.

Credentials (task_objects): the task gets a readers.objects.Objects of the URL made by the
driver with its storage_options and, for what they leave out, the driver's standard settings
(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_ENDPOINT_URL, AWS_REGION) as
the client's options, so they win over a node's own environment; what the driver does not set
the node's own environment (or instance role) gives. It travels in the task's arguments (Ray
serialises them to the node) and is never printed: UnitSpec's repr leaves it out.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..readers.objects import one_line
from .options import PackError
from .parts_rows import files_of

UPLOADED = "uploaded"  # a part summary's {name: ETag} of the files its task put
# the driver's settings a task takes (obstore's option names): the standard AWS_* variables
FORWARDED = {"AWS_ACCESS_KEY_ID": "access_key_id", "AWS_SECRET_ACCESS_KEY": "secret_access_key",
             "AWS_SESSION_TOKEN": "session_token", "AWS_ENDPOINT_URL": "endpoint", "AWS_DEFAULT_REGION": "region",
             "AWS_REGION": "region"}


def task_objects(url: str, storage_options: dict | None):
    """The readers.objects.Objects of ``url`` the nodes put its parts with: ``storage_options``,
    and for the options they leave out the driver's AWS_* settings (FORWARDED; s3:// only)."""
    from ..readers.objects import Objects
    options = dict(storage_options or {})
    if url.startswith("s3://"):
        taken = {FORWARDED.get(k, k) for k in options} | ({"endpoint"} if "endpoint_url" in options else set())
        for env, key in FORWARDED.items():
            if os.environ.get(env) and key not in taken:
                options[key] = os.environ[env]
    return Objects(url, options)


def upload_part(objects, part: dict, out_dir: Path, keep=None) -> dict:
    """Put the files of the part summary ``part`` (parts_rows.files_of: the part file, then its
    row table; names relative to the output folder ``out_dir``) under ``objects``, then remove
    the local part file; ``keep(path)``, when given, is called first with the part file's path
    (what the driver still needs of it: HDF5's columns). Returns the summary with
    ``"uploaded"``: {name: ETag}. Raises PackError naming the object's URL when the store fails
    (after the client's retries)."""
    from obstore.exceptions import BaseError

    from .multipart import put_file
    store, uploaded = objects.store(), {}
    for name, _, _ in files_of(part):
        try:
            with open(Path(out_dir) / name, "rb") as f:
                uploaded[name] = put_file(store, name, f, os.fstat(f.fileno()).st_size)
        except (BaseError, OSError) as err:
            raise PackError(f"{objects.url}/{name}: cannot upload the part ({one_line(err)})") from None
    local = Path(out_dir) / part["name"]
    if keep is not None:
        keep(local)
    os.unlink(local)
    return {**part, UPLOADED: uploaded}


def uploaded_part(part: dict) -> str | None:
    """The name of a part summary's part file when its task uploaded it (and removed the local
    copy), else None."""
    return part["name"] if part.get(UPLOADED) else None


def remote_files(local: Path, manifests: list[str]) -> tuple[dict[str, int], set[str]]:
    """Of the staged output ``local`` (``manifests``: the relative paths of its manifest.json
    files): ({key under the URL: bytes} of the files they list but ``local`` does not hold, the
    parts their nodes uploaded; the keys of the part-layout row tables it holds, which those
    nodes put too)."""
    import json
    out, rows = {}, set()
    for name in manifests:
        if Path(name).name != "manifest.json":
            continue
        folder = Path(name).parent
        made = json.loads((local / name).read_text())
        for f, nbytes in (made.get("files") or {}).items():
            key = (folder / f).as_posix()
            if not (local / key).exists():
                out[key] = int(nbytes)
        rows |= {(folder / p["rows"]["name"]).as_posix() for p in made.get("parts") or () if p.get("rows")}
    return out, rows


def task_etags(writers) -> dict[str, str]:
    """{key under the URL: ETag} of every file the nodes put for ``writers`` ([(folder relative
    to the URL, "." for the top, a PartsWriter)], their parts' "uploaded")."""
    return {(name if base == "." else f"{base}/{name}"): etag for base, w in writers
            for p in w.parts.values() for name, etag in (p.get(UPLOADED) or {}).items()}


def check_remote(url: str, listing: dict, remote: dict[str, int], etags: dict[str, str]) -> None:
    """Refuse (PackError, one line naming the object) a commit where a file a node uploaded
    (``remote``: {key: bytes}) is not in ``listing`` (one LIST of the URL: {key: meta}) with
    that size and, where this run knows it (``etags``), that ETag."""
    for key, nbytes in sorted(remote.items()):
        there = listing.get(key)
        if there is None or int(there["size"]) != nbytes or (key in etags and etags[key] != there.get("e_tag")):
            found = "missing" if there is None else f"{there['size']} bytes, ETag {there.get('e_tag')}"
            raise PackError(f"{url}/{key}: uploaded by its node as {nbytes} bytes but now {found} (replaced or "
                            "deleted under the run?); pass --overwrite to pack the output again")
