"""The S3 test server itself (tests/s3server.py): it serves what was put, refuses wrong credentials."""

from __future__ import annotations

import pytest


def test_the_server_serves_ranges_and_refuses_wrong_credentials(s3):
    import obstore
    from obstore.exceptions import PermissionDeniedError
    from obstore.store import S3Store

    import s3server

    store = S3Store("fixture-check", endpoint=s3.endpoint, client_options={"allow_http": True})
    obstore.put(store, "x/blob", bytes(range(256)) * 4)  # the bucket is made on the first upload
    assert bytes(obstore.get_range(store, "x/blob", start=250, end=260)) == bytes([250, 251, 252, 253, 254, 255,
                                                                                   0, 1, 2, 3])
    assert obstore.head(store, "x/blob")["size"] == 1024
    wrong = S3Store("fixture-check", endpoint=s3.endpoint, client_options={"allow_http": True},
                    access_key_id=s3server.ACCESS_KEY, secret_access_key="not-the-secret")
    with pytest.raises(PermissionDeniedError, match="403"):
        obstore.head(wrong, "x/blob")
