"""gs:// and local paths in one vocabulary (inspect_tool/storage/paths.py), checked against the emulator."""

import tensorstore as ts

from gcs_emulator import BUCKET
from inspect_tool.storage import paths


def test_gs_paths_normalize_join_and_split_without_losing_the_scheme():
  assert paths.normalize("gs://b//run/./ckpt/../ckpt/") == "gs://b/run/ckpt"
  assert paths.normalize("gs://b/") == "gs://b"
  assert paths.join("gs://b/run/", "3", "items") == "gs://b/run/3/items"
  assert paths.parent("gs://b/run/3") == "gs://b/run" and paths.parent("gs://b/run") == "gs://b"
  assert paths.basename("gs://b/run/3/") == "3"
  assert paths.split("gs://b/run/3") == ("b", "run/3")
  assert paths.normalize("a//b/../c") == "a/c" and not paths.is_remote("a/gs://x")


def test_a_kvstore_spec_reads_the_objects_under_a_gs_prefix(gcs, tmp_path):
  (tmp_path / "x.bin").write_bytes(b"abc")
  url = gcs.upload(tmp_path, f"gs://{BUCKET}/paths-check")
  kv = ts.KvStore.open(paths.kvstore_spec(url)).result()
  assert kv.read("x.bin").result().value == b"abc"
  assert paths.epath(url + "/x.bin").read_bytes() == b"abc"
  assert paths.epath(url).is_dir() and not paths.epath(url + "-none").exists()
