"""What the tests of packing into object storage (test_s3_write.py, test_s3_write_lock.py) share: the
bucket, a client of the test server (tests/s3server.py), its listing, a download, the lock object."""

from __future__ import annotations

from pathlib import Path

BUCKET = "shardpack-writes"


def store(s3):
    from obstore.store import S3Store
    return S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True})


def objects(s3, prefix: str) -> dict[str, dict]:
    """{key under prefix: its meta (size, e_tag, last_modified)}."""
    import obstore
    return {m["path"][len(prefix) + 1:]: m for page in obstore.list(store(s3), prefix=prefix) for m in page}


def download(s3, prefix: str, dest: Path) -> Path:
    import obstore
    for key in objects(s3, prefix):
        (dest / key).parent.mkdir(parents=True, exist_ok=True)
        (dest / key).write_bytes(bytes(obstore.get(store(s3), f"{prefix}/{key}").bytes()))
    return dest


def lock_key(prefix: str) -> str:
    head, _, name = prefix.rpartition("/")
    return f"{head}/.{name}.lock"


def locked(s3, prefix: str) -> bool:
    """Whether the lock object beside ``prefix`` exists."""
    import obstore
    try:
        obstore.head(store(s3), lock_key(prefix))
        return True
    except FileNotFoundError:
        return False
