"""Mapped reads of a local source (`storage/mapped_reads.py`): the file system of a path is found from the mount
table (the longest mount point holding it, the last mounted of equal ones), only local disk and memory file
systems are mapped, and the export's source stores read the same values either way."""

from __future__ import annotations

import numpy as np
import pytest

from inspect_tool.streaming import read
from inspect_tool.paramtree import tree
from inspect_tool.storage import mapped_reads

# Fields as the kernel writes them (proc(5)); a space in a mount point is written \040.
MOUNTS = """\
22 1 0:21 / /proc rw,relatime - proc proc rw
27 1 259:1 / / rw,relatime - ext4 /dev/root rw
40 27 0:50 / /mnt/ckpt rw,nosuid,nodev - fuse.gcsfuse my-bucket rw,user_id=0
41 27 259:2 / /mnt/my\\040disk rw - xfs /dev/nvme1n1 rw
42 27 0:51 / /data rw - nfs4 server:/export rw
43 27 0:52 / /data rw - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
44 27 0:53 / /mnt/ckptx rw - tmpfs tmpfs rw
45 27 0:54 / /mnt/mes\\040données rw - fuse.sshfs host:/d rw
"""


@pytest.fixture
def mounts(tmp_path, monkeypatch):
  table = tmp_path / "mountinfo"
  table.write_text(MOUNTS)
  monkeypatch.setattr(mapped_reads, "MOUNTINFO", str(table))


@pytest.mark.parametrize("path, kind, allowed", [
    ("/home/me/ckpt/0/items", "ext4", True),
    ("/mnt/ckpt/run/0/items", "fuse.gcsfuse", False),
    ("/mnt/ckpt", "fuse.gcsfuse", False),
    ("/mnt/ckptx/0", "tmpfs", True),  # a sibling whose name starts like another mount point's
    ("/mnt/my disk/0/items", "xfs", True),
    ("/data/0/items", "overlay", True),  # mounted over the NFS mount at the same point
    ("/proc/self", "proc", False),
    ("/mnt/mes données/0", "fuse.sshfs", False),  # not ASCII, with an escape
])
def test_the_file_system_of_a_path_is_its_longest_mount_point_s(mounts, path, kind, allowed):
  assert mapped_reads.fs_type(path) == kind
  assert mapped_reads.allowed(path) is allowed


def test_an_unreadable_mount_table_maps_nothing(tmp_path, monkeypatch):
  monkeypatch.setattr(mapped_reads, "MOUNTINFO", str(tmp_path / "absent"))
  assert mapped_reads.fs_type("/") is None and not mapped_reads.allowed("/")


def test_only_file_kvstores_on_allowed_file_systems_are_mapped(mounts):
  spec = {"driver": "file", "path": "/home/me/ckpt/"}
  assert mapped_reads.kvstore_spec(spec, "/home/me/ckpt") == dict(spec, file_io_mode={"mode": "memmap"})
  assert mapped_reads.kvstore_spec({"driver": "file", "path": "/mnt/ckpt/x/"}, "/mnt/ckpt/x") == {
      "driver": "file", "path": "/mnt/ckpt/x/"}
  gcs = {"driver": "gcs", "bucket": "b", "path": "x/"}
  assert mapped_reads.kvstore_spec(gcs, "gs://b/x") is gcs


def _saved(path) -> np.ndarray:
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  value = np.random.default_rng(3).standard_normal((64, 48), np.float32)
  with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)) as checkpointer:
    checkpointer.save(str(path / "0" / "items"), {"params": {"params": {"w": jnp.asarray(value)}}})
  return value


@pytest.mark.parametrize("local", [True, False])
def test_the_source_s_stores_map_their_files_only_where_allowed_and_read_the_saved_values(tmp_path, monkeypatch,
                                                                                         local):
  value = _saved(tmp_path)
  table = tmp_path / "mountinfo"
  kind = "ext4" if local else "fuse.gcsfuse"
  table.write_text(f"27 1 259:1 / / rw - ext4 /dev/root rw\n50 27 0:60 / {tmp_path} rw - {kind} x rw\n")
  monkeypatch.setattr(mapped_reads, "MOUNTINFO", str(table))
  key = ("params", "params", "w")
  source = read.CheckpointSource(str(tmp_path / "0"), [tree.Leaf(key, value.shape, "float32")])
  store = source.open(key)
  base = store.kvstore.base.spec(retain_context=True).to_json()
  assert base["file_io_mode"] == ({"mode": "memmap"} if local else {})
  np.testing.assert_array_equal(np.asarray(store[8:40, 5:].read().result()), value[8:40, 5:])
