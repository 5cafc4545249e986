"""The test emulator itself: what tests/gcs_emulator.py uploads, tensorstore's gcs driver and Orbax's path layer
(etils epath) read back, byte for byte."""

import numpy as np
import tensorstore as ts
from etils import epath

from gcs_emulator import BUCKET


def test_uploaded_files_read_back_through_tensorstore_and_epath(gcs, tmp_path):
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "a.bin").write_bytes(bytes(range(256)) * 3)
  (tmp_path / "b.txt").write_text("hello")
  url = gcs.upload(tmp_path, f"gs://{BUCKET}/emulator-check")
  assert gcs.listing(url) == ["b.txt", "sub/a.bin"]
  kv = ts.KvStore.open(url + "/").result()
  assert kv.read("sub/a.bin").result().value == bytes(range(256)) * 3
  assert epath.Path(url, "b.txt").read_text() == "hello"


def test_a_zarr_array_written_by_tensorstore_lists_in_the_emulator(gcs):
  url = f"gs://{BUCKET}/emulator-array"
  array = ts.open({"driver": "zarr3", "kvstore": url}, create=True, dtype=ts.float32, shape=[8, 8]).result()
  array[...] = np.arange(64, dtype=np.float32).reshape(8, 8)
  assert "zarr.json" in gcs.listing(url)
  np.testing.assert_array_equal(array[2:4, 1].read().result(), [17.0, 25.0])
