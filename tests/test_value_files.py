"""`storage.value_files.locate`: the file and byte range it names for a key hold exactly the bytes tensorstore
reads for that key, in OCDBT databases of several B-tree levels, in Orbax's own (per-process databases under the
root) and in plain file kvstores; anything it cannot place is None."""

from __future__ import annotations

import numpy as np

from inspect_tool.storage import value_files


def _located_bytes(found) -> bytes:
  with open(found.path, "rb") as f:
    f.seek(found.offset)
    return f.read(found.nbytes)


def test_every_key_of_a_deep_database_is_found_where_tensorstore_reads_it(tmp_path):
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  config = {"max_decoded_node_bytes": 400, "max_inline_value_bytes": 16}  # several levels; small values inline
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/", "config": config}).result()
  txn = ts.Transaction()
  rng = np.random.default_rng(0)
  values = {f"w{i % 7}/c/{i:04d}": rng.bytes(int(rng.integers(17, 3000))) for i in range(240)}
  for key, value in values.items():
    kv.with_transaction(txn).write(key, value).result()
  kv.with_transaction(txn).write("tiny", b"inline").result()
  txn.commit_async().result()
  base = ts.KvStore.open(f"file://{tmp_path}/").result()
  assert ts.ocdbt.dump(base).result()["versions"][-1]["root_height"] >= 2
  for key, value in values.items():
    assert _located_bytes(value_files.locate(kv, key)) == value
    prefix, _, rest = key.partition("/")
    assert value_files.locate(kv / (prefix + "/"), rest) == value_files.locate(kv, key)  # a kvstore with a path
  assert value_files.locate(kv, "tiny") is None  # inline: in the B-tree node, not a data file
  assert value_files.locate(kv, "w0/c/9999") is None and value_files.locate(kv, "zz") is None


def test_orbax_s_per_process_databases_and_plain_files(tmp_path):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  items = tmp_path / "items"
  tree = {"a": jnp.arange(4096, dtype=jnp.float32).reshape(64, 64), "b": jnp.ones((3, 5), jnp.bfloat16)}
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)) as checkpointer:
    checkpointer.save(str(items), tree)
  root = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{items}/"}).result()
  chunks = [k.decode() for k in root.list().result() if b"/c" in k]
  found = {key: value_files.locate(root, key) for key in chunks}
  assert any("ocdbt.process_" in f.path for f in found.values() if f)  # values in a process's database
  for key, where in found.items():
    if where is not None:
      assert _located_bytes(where) == root.read(key).result().value
  assert found["a/c/0/0"] is not None  # 16 KB: stored in a data file
  plain = ts.open({"driver": "zarr3", "kvstore": f"file://{tmp_path}/plain/", "create": True,
                   "metadata": {"shape": [4], "data_type": "float32",
                                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2]}}}}).result()
  plain.write(np.arange(4, dtype=np.float32)).result()
  where = value_files.locate(plain.kvstore, "c/1")
  assert where.path == str(tmp_path / "plain" / "c" / "1") and _located_bytes(where) == np.float32([2, 3]).tobytes()


def test_stores_not_on_a_local_disk_are_not_placed():
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  memory = ts.KvStore.open({"driver": "ocdbt", "base": "memory://"}).result()
  memory.write("k", b"x" * 5000).result()
  assert value_files.locate(memory, "k") is None
  assert value_files.locate(ts.KvStore.open("memory://").result(), "k") is None
