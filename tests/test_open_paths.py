"""What ``ShardDataset`` says for a path that is not an output: a URL (until object storage lands),
a file of an output, another file, nothing there; each one line naming what was given."""

import pytest

from helpers import make_tree, packed
from shardpack.readers import ShardDataset
from shardpack.readers.manifest import ShardFormatError


@pytest.fixture
def out(tmp_path):
    return packed("npy", make_tree(tmp_path / "src", {"a": 2, "b": 2}), tmp_path / "o.npy")


@pytest.mark.parametrize("split", [None, "val"])
def test_a_url_is_named_as_typed_and_refused(split):
    """It read "s3:/b/x.npy: no such shardpack output directory" (the URL mangled by Path). URLs
    are opened from object storage now (tests/test_s3.py); these are refused before any request."""
    with pytest.raises(ShardFormatError) as err:
        ShardDataset("s3://b/x.npy", split=split)
    assert str(err.value) == "s3://b/x.npy: 'b' is not an S3 bucket name (3 to 63 characters: s3://BUCKET/prefix/OUT)"
    with pytest.raises(ShardFormatError) as err:
        ShardDataset("https://example.org/x.npy", split=split)
    assert str(err.value).startswith("https://example.org/x.npy: ")


def test_a_file_inside_an_output_points_to_its_folder(out, tmp_path):
    with pytest.raises(ShardFormatError) as err:
        ShardDataset(out / "images.npy")
    assert str(err.value) == (f"{out / 'images.npy'}: no such shardpack output directory (images.npy is a file "
                              f"of one; open its folder {out})")
    with pytest.raises(ShardFormatError, match=r"no such shardpack output directory \(a file: an output is a "
                                               r"directory\)$"):
        ShardDataset(tmp_path / "src" / "a" / "img000.jpg")
    with pytest.raises(ShardFormatError, match=r"nothing: no such shardpack output directory$"):
        ShardDataset(tmp_path / "nothing")
    assert len(ShardDataset(out)) == 4
