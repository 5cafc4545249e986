"""Exports to gs:// are written straight under the staging prefix by every process
(inspect_tool/output/object_store.py), against fake-gcs-server (the `gcs` fixture): Orbax's own API restores the
gs:// export as it restores the local one, and an export larger than the local temporary directory's file system
goes through, each process of a job with a 64 MiB tmpfs of its own as TMPDIR (slow: it mounts file systems, as
root); a gs:// database closes its data files at their target size, so that one commit is several uploads."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from gcs_emulator import BUCKET
from inspect_tool import cli
from inspect_tool.storage import objects
from inspect_tool.streaming import orbax_writer
from test_export import CKPT, TINY, _tokens
from test_export_distributed import _run_processes, finish

from conftest import REPO
TMPFS_BYTES = 64 << 20
# 2**18 rows of 64: the embedding and the logits head are 64 MiB each (float32), copied as stored (128 MiB in all).
BIG = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=2",
       "first_num_dense_layers=1", "vocab_size=262144"]


def _leaves(tree) -> dict:
  return {jax.tree_util.keystr(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_orbax_restores_the_gs_export_as_it_restores_the_local_one(gcs, tmp_path, capsys):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  local, remote = tmp_path / "local", f"gs://{BUCKET}/orbax-api/fp8"
  for dst in (str(local), remote):
    assert cli.main(["export", *_tokens(True), "--checkpoint", CKPT, "--output", dst, "--no-validate"]) == 0
  capsys.readouterr()
  handler = ocp.PyTreeCheckpointHandler()  # Orbax's own reader: metadata, then every array onto a device
  items = {"local": epath.Path(local / "0" / "items"), "gs": epath.Path(remote) / "0" / "items"}
  metadata = {k: _leaves(handler.metadata(path).tree) for k, path in items.items()}
  assert sorted(metadata["gs"]) == sorted(metadata["local"]) and len(metadata["local"]) == 86
  for name, meta in metadata["local"].items():
    other = metadata["gs"][name]
    assert (other.shape, other.dtype, other.storage, other.sharding) == (meta.shape, meta.dtype, meta.storage,
                                                                         meta.sharding), name
  checkpointer = ocp.PyTreeCheckpointer()
  restored = {k: _leaves(checkpointer.restore(path)) for k, path in items.items()}
  assert sorted(restored["gs"]) == sorted(restored["local"]) == sorted(metadata["local"])
  for name, value in restored["local"].items():
    a, b = np.asarray(value), np.asarray(restored["gs"][name])
    assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), name
  assert ocp.step.is_checkpoint_finalized(epath.Path(remote) / "0")


@contextlib.contextmanager
def _tmpfs(parent: str, count: int):
  """`count` fresh tmpfs mounts of `TMPFS_BYTES` each under `parent` (unmounted afterwards)."""
  mounts = []
  try:
    for i in range(count):
      path = os.path.join(parent, f"tmpfs{i}")
      os.mkdir(path)
      subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", path], check=True)
      mounts.append(path)
    yield mounts
  finally:
    for path in mounts:
      subprocess.run(["umount", path], check=False)


def _stored_bytes(gcs, url: str) -> int:
  root = gcs.data_dir / BUCKET / url[len(f"gs://{BUCKET}/"):]
  return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.slow  # mounts a tmpfs per process and exports 130 MB
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts tmpfs file systems (root)")
def test_an_export_larger_than_each_processs_tmpdir_goes_straight_to_gs(gcs, tmp_path):
  import export_sources  # pylint: disable=import-outside-toplevel

  source = tmp_path / "source"
  export_sources.write_source(str(source / "0"), BIG)
  orbax, hf = f"gs://{BUCKET}/big/orbax", f"gs://{BUCKET}/big/hf"
  with _tmpfs(tempfile.mkdtemp(dir=tmp_path), 3) as (one, two, three):
    command = ["export", *BIG, "quantization=fp8_full", "--checkpoint", str(source), "--no-validate"]
    outs = _run_processes([*command, "--output", orbax], envs=[{"TMPDIR": one}, {"TMPDIR": two}], timeout=400)
    for code, _, err in outs:
      assert code == 0, err[-3000:]
    single = subprocess.Popen([sys.executable, "-m", "inspect_tool", *command, "--output", hf, "--layout",
                               "deepseek-fp8", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO, env=dict(os.environ, JAX_PLATFORMS="cpu", TMPDIR=three))
    ((code, _, err),) = finish([single], timeout=400)
    assert code == 0, err[-3000:]
    assert [os.listdir(path) for path in (one, two, three)] == [[], [], []]
  for url in (orbax, hf):
    assert _stored_bytes(gcs, url) > TMPFS_BYTES  # each export is larger than a process's TMPDIR could hold
  names = gcs.listing(orbax)
  assert {"0/items/ocdbt.process_0/manifest.ocdbt", "0/items/ocdbt.process_1/manifest.ocdbt"} <= set(names)
  assert names[-3:] == ["commit_success.txt", "export_manifest.json", "quantization_report.json"]
  assert cli.main(["verify", orbax]) == 0 and cli.main(["verify", hf]) == 0
  assert gcs.listing(f"gs://{BUCKET}/big") == sorted([f"orbax/{n}" for n in names]
                                                     + [f"hf/{n}" for n in gcs.listing(hf)])


def _data_files(items: str) -> list[int]:
  """The sizes of the data files of process 0's database under `items` (local directory or gs:// prefix)."""
  prefix = f"{items}/{orbax_writer.PROCESS_DIR.format(0)}/d"
  if items.startswith("gs://"):
    return sorted(len(objects.read(f"{prefix}/{name}")[0]) for name in objects.names(prefix))
  return sorted(os.path.getsize(os.path.join(prefix, name)) for name in os.listdir(prefix))


def test_a_gs_database_closes_each_data_file_at_its_target_size(gcs, tmp_path, monkeypatch):
  """One write of 256 chunks of 16 KiB (random: zstd keeps most of their size), committed in a few batches: on
  gs:// its data files close at `REMOTE_DATA_FILE_BYTES` (here 64 KiB), each a request of its own, none above the
  target and one chunk; a local database (no target) keeps a batch in one file, larger. The values read back
  whole either way."""
  monkeypatch.setattr(orbax_writer, "REMOTE_DATA_FILE_BYTES", 64 << 10)
  value = np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32)
  most = (64 << 10) + (16 << 10)
  for items in (str(tmp_path / "items"), f"gs://{BUCKET}/data-files/items"):
    writer = orbax_writer.OrbaxArrayWriter(items)
    store = writer.create(("params", "w"), value.shape, value.dtype, (1, 4096))
    writer.write(store, (slice(0, 256), slice(0, 4096)), value)
    writer.wait()
    np.testing.assert_array_equal(store.read().result(), value)
    sizes = _data_files(items)
    if items.startswith("gs://"):
      assert sizes[-1] <= most and len(sizes) >= sum(sizes) // most, sizes
    else:
      assert sizes[-1] > 4 * most, sizes
