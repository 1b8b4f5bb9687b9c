"""``shardpack info URL`` and ``shardpack verify URL`` against a real S3 server (SeaweedFS): the
output described from its mirrored small files, every object's digest checked by streamed GETs,
damage named by URL; other URL schemes still refused in one line."""

from __future__ import annotations

import json

import pytest

from helpers import make_tree, packed, run_cli
from test_s3 import BUCKET, upload


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("s3commands")
    src = make_tree(d / "src", {"cat": 5, "dog": 4})
    splits = d / "splits-src"
    make_tree(splits / "train", {"ant": 3, "bee": 2})
    make_tree(splits / "val", {"ant": 2, "bee": 2}, seed=50)
    result = run_cli(splits, "--format", "hdf5", "--size", "16", "--no-progress", "--workers", "1", "-o", d / "splits")
    assert result.exit_code == 0, result.output
    return {"wds": packed("wds", src, d / "wds", size=16, shard_size=3000),
            "jpeg": packed("lmdb", src, d / "jpeg", size=16, encoding="jpeg"), "splits": d / "splits"}


def put(s3, key: str, data: bytes) -> None:
    import obstore
    from obstore.store import S3Store
    obstore.put(S3Store(BUCKET, endpoint=s3.endpoint, client_options={"allow_http": True}), key, data)


def test_info_of_a_url_describes_it_from_its_mirror(s3, cache, outputs):
    url = upload(s3, outputs["wds"], "cmd/info/OUT")
    local = run_cli("info", outputs["wds"], command="shardpack")
    result = run_cli("info", url, command="shardpack")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == url and lines[1:3] == local.output.splitlines()[1:3]  # format, samples
    assert "  in store    " in result.output and str(cache) in result.output
    [case] = [line for line in lines if line.startswith("  cache       ")]
    assert case.startswith(f"  cache       block cache {cache} (") and " holds all " in case  # the cache case
    doc = json.loads(run_cli("info", url, "--json", command="shardpack").output)
    assert doc["ok"] and doc["datasets"][0]["path"] == url
    assert doc["datasets"][0]["bytes_on_disk"] == sum(doc["datasets"][0]["manifest"]["files"].values())
    splits = upload(s3, outputs["splits"], "cmd/info-splits/OUT")
    result = run_cli("info", splits, command="shardpack")
    assert result.exit_code == 0, result.output
    assert [line for line in result.output.splitlines() if line.startswith("split ")] == [
        f"split train: {splits}/train", f"split val: {splits}/val"]


def test_the_cache_case_says_smaller_than_the_data_or_off(s3, cache, outputs):
    from shardpack.readers.cachesetup import choose
    from shardpack.readers.mirror import open_url
    url = upload(s3, outputs["jpeg"], "cmd/info-case/OUT")
    _, objects = open_url(url)
    data = sum(size for size, _ in objects.pixels.values())
    got, text = choose(objects, cache_limit=data // 2)
    assert got.limit == data // 2 and text.startswith(f"{url}: block cache {cache} (") and " is smaller than " in text
    got, text = choose(objects, cache_limit=data)
    assert got.limit == data and " holds all " in text
    assert choose(objects, cache_limit=0) == (None, f"{url}: no block cache (cache_limit=0): every epoch fetches "
                                                    f"all {text.split(' holds all ')[1].split(' of pixels')[0]} "
                                                    "it reads")


@pytest.mark.parametrize("name", ["wds", "jpeg", "splits"])
def test_verify_of_a_url_checks_every_object_and_sample(s3, cache, outputs, name):
    url = upload(s3, outputs[name], f"cmd/verify-{name}/OUT")
    result = run_cli("verify", url, "--quiet", command="shardpack")
    assert result.exit_code == 0, result.output
    roots = [url] if name != "splits" else [f"{url}/train", f"{url}/val"]
    count = {"wds": 9, "jpeg": 9, "splits": None}[name]
    for root in roots:
        assert (f"{root}: all {count if count else ''}" in result.output if count else
                f"{root}: all " in result.output)
        assert "and its " in result.output and "files their digests" in result.output
    doc = json.loads(run_cli("verify", url, "--json", "--quiet", command="shardpack").output)
    assert doc["ok"] and [d["path"] for d in doc["datasets"]] == roots
    assert all(d["digests_checked"] > 3 and d["not_covered"] == [] for d in doc["datasets"])


def test_verify_of_a_url_names_each_damaged_object(s3, cache, outputs):
    url = upload(s3, outputs["wds"], "cmd/damaged/OUT")
    shard = bytearray((outputs["wds"] / "shard-000001.tar").read_bytes())
    shard[-2000] ^= 0xFF  # a pixel byte of the last member (tar ends with 1024 zero bytes)
    put(s3, "cmd/damaged/OUT/shard-000001.tar", bytes(shard))
    put(s3, "cmd/damaged/OUT/stray.txt", b"added after the pack")
    result = run_cli("verify", url, "--quiet", command="shardpack")
    assert result.exit_code == 1
    assert (f"PROBLEM {url}/shard-000001.tar: its content differs from its xxh3_128 digest in manifest.json "
            "(recorded at pack time): the object is damaged") in result.output
    assert f"NOTE {url}: 1 object(s) no digest covers (added after the pack?), not checked: stray.txt" in result.output
    labels = bytearray((outputs["wds"] / "index/labels.npy").read_bytes())
    labels[-1] ^= 1
    put(s3, "cmd/damaged/OUT/index/labels.npy", bytes(labels))
    doc = json.loads(run_cli("verify", url, "--json", "--quiet", command="shardpack").output)
    assert not doc["ok"] and sorted(p.split(":")[0] + ":" + p.split(":")[1] for p in doc["problems"]) == [
        f"{url}/index/labels.npy", f"{url}/shard-000001.tar"]


def test_a_url_of_another_scheme_is_refused_in_one_line(s3, cache):
    result = run_cli("info", "http://example.org/OUT", command="shardpack")
    assert result.exit_code == 2 and result.output.strip() == (
        "Error: Invalid value for 'OUT': http://example.org/OUT is a URL; of object storage only s3://, gs://, az:// "
        "are supported here: copy the output to a local disk and open that path")
    put(s3, "cmd/somewhere-else", b"x")  # the bucket exists (run alone, this test would make no other object)
    result = run_cli("verify", "s3://shardpack-tests/cmd/nothing", "--quiet", command="shardpack")
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: s3://shardpack-tests/cmd/nothing: no manifest.json there; not a complete shardpack output (check "
        "the bucket and prefix; a packing run writes it last)")
    result = run_cli("info", "s3://no-such-bucket/OUT", command="shardpack")  # the bucket itself missing: said so
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1] == (
        "Error: s3://no-such-bucket/OUT: the bucket 'no-such-bucket' does not exist at this endpoint (check its "
        "name, and AWS_ENDPOINT_URL / AWS_REGION or storage_options)")


def test_info_json_gives_the_cache_case_with_its_sizes(s3, cache, outputs):
    from shardpack.readers.cachesetup import record
    from shardpack.readers.mirror import open_url
    url = upload(s3, outputs["wds"], "cmd/info-json-cache/OUT")
    data = sum(size for name, size in json.loads((outputs["wds"] / "manifest.json").read_text())["files"].items()
               if name.startswith("shard-"))
    doc = json.loads(run_cli("info", url, "--json", command="shardpack").output)
    got = doc["datasets"][0]["cache"]
    assert got["case"] == "holds all" and got["dir"] == str(cache) and got["data_bytes"] == data > 0
    assert got["limit_bytes"] >= data and got["fetch_per_epoch_bytes"] == 0
    [line] = [x for x in run_cli("info", url, command="shardpack").output.splitlines() if x.startswith("  cache ")]
    assert line == f"  cache       {got['text']}"  # the very case the text prints
    assert json.loads(run_cli("info", outputs["wds"], "--json", command="shardpack").output)["datasets"][0][
        "cache"] is None  # a local output has no block cache
    _, objects = open_url(url)
    smaller = record(objects, cache_limit=data // 2)
    assert smaller["case"] == "smaller than the data" and smaller["limit_bytes"] == data // 2
    assert smaller["fetch_per_epoch_bytes"] == data - data // 2 and " is smaller than " in smaller["text"]
    for off in (record(objects, cache_limit=0), record(objects, cache_dir=False)):
        assert (off["case"], off["dir"], off["limit_bytes"], off["fetch_per_epoch_bytes"]) == ("off", None, 0, data)
        assert off["text"].startswith("no block cache (")
    refused = record(objects, cache_limit="lots")
    assert refused["case"] == "refused" and "lots" in refused["text"]
