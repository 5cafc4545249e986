"""Tests for inspect_tool.checkpoint.orbax_metadata and .locate: metadata-only Orbax listings and path rules."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from inspect_tool import errors
from inspect_tool.paramtree import tree
from inspect_tool.checkpoint import locate
from inspect_tool.checkpoint import orbax_metadata

from conftest import DATA
REF_CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
REF_LISTING = os.path.join(DATA, "listings", "orbax_ckpt_deepseek3-tiny-L4-V1024.txt")


def _maxtext_lines(leaves):
  """MaxText's orbax-mode line format, params only."""
  return [f"key: {l.dotted} | shape: {l.shape} | dtype: {l.dtype}" for l in leaves if l.dotted.startswith("params")]


def _copy(tmp_path):
  dst = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, dst)
  for root, dirs, files in os.walk(dst):
    for name in dirs + files:
      os.chmod(os.path.join(root, name), 0o755)
  return dst


_WRITER = r"""
import sys
import jax.numpy as jnp
import orbax.checkpoint as ocp
import orbax.checkpoint.experimental.v1 as ocp_v1
state = {
    "params": {"params": {"decoder": {"moe_layers_0": {"w": jnp.ones((4, 3), jnp.bfloat16)}},
                          "token_embedder": {"embedding": jnp.zeros((8, 4), jnp.float32)}}},
    "nnx_aux": {"model": {"decoder": {"gate": {"bias": jnp.zeros((3,), jnp.float32)},
                                      "rngs": {"params": {"count": jnp.zeros((), jnp.uint32)}}}}},
    "opt_state": [{"count": jnp.zeros((), jnp.int32), "mu": {"params": {"decoder": {"w": jnp.ones((4, 3))}}}}, None],
    "step": jnp.int32(7),
}
ocp_v1.save(sys.argv[1] + "/7", state, checkpointable_name="items")
with ocp.PyTreeCheckpointer(use_ocdbt=False, use_zarr3=False) as ck:
  ck.save(sys.argv[2] + "/items", state)
"""


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """A training-layout checkpoint written by Orbax twice: OCDBT+zarr3 (step 7) and plain zarr2 files."""
  root = tmp_path_factory.mktemp("written")
  ocdbt, plain = root / "ocdbt", root / "plain"
  subprocess.run([sys.executable, "-c", _WRITER, str(ocdbt), str(plain)], check=True, capture_output=True,
                 env=dict(os.environ, JAX_PLATFORMS="cpu"))
  return ocdbt, plain


def test_reference_listing_matches_maxtext_orbax_mode_exactly():
  want = [line for line in open(REF_LISTING).read().splitlines() if line.startswith("key:")]
  assert _maxtext_lines(orbax_metadata.read_leaves(os.path.join(REF_CKPT, "0", "items"))) == want


def test_every_accepted_path_form_resolves_to_the_items_dir():
  items = os.path.join(REF_CKPT, "0", "items")
  for path, note in ((REF_CKPT, "using step 0"), (os.path.join(REF_CKPT, "0"), ""), (items, "")):
    resolved = locate.resolve_orbax_path(path)
    assert (os.path.normpath(resolved.items_dir), resolved.step, resolved.note) == (os.path.normpath(items), 0, note)


def test_directory_of_steps_takes_the_latest_numeric_step(tmp_path):
  for step in (2, 10, 9):
    shutil.copytree(os.path.join(REF_CKPT, "0"), tmp_path / str(step))
  (tmp_path / "11.orbax-checkpoint-tmp-123").mkdir()  # unfinished save: ignored
  (tmp_path / "12").mkdir()  # empty numeric dir: not a checkpoint, skipped
  resolved = locate.resolve_orbax_path(str(tmp_path))
  assert resolved.step == 10 and resolved.items_dir == str(tmp_path / "10" / "items")
  assert resolved.note == "using latest step 10 (of 2, 9, 10)"


def test_reference_listing_includes_the_step_item():
  listing = orbax_metadata.read_listing(REF_CKPT)
  assert listing.items()["step"] == [tree.Leaf(("step",), (), "int64")]
  assert len(listing.items()["params"]) == 53


def test_training_layout_groups_every_item_and_folds_list_indices(written):
  ocdbt, _ = written
  listing = orbax_metadata.read_listing(str(ocdbt))
  assert listing.resolved.step == 7 and listing.use_ocdbt and listing.use_zarr3
  groups = {item: [(l.dotted, l.shape, l.dtype) for l in leaves] for item, leaves in listing.items().items()}
  assert groups == {
      "nnx_aux": [("nnx_aux.model.decoder.gate.bias", (3,), "float32"),
                  ("nnx_aux.model.decoder.rngs.params.count", (), "uint32")],
      "opt_state": [("opt_state_0.count", (), "int32"), ("opt_state_0.mu.params.decoder.w", (4, 3), "float32")],
      "params": [("params.params.decoder.moe_layers_0.w", (4, 3), "bfloat16"),
                 ("params.params.token_embedder.embedding", (8, 4), "float32")],
      "step": [("step", (), "int32")],
  }
  assert listing.raw_keys[("opt_state_0", "count")] == ("opt_state", 0, "count")


def test_plain_zarr2_checkpoint_lists_the_same_leaves(written):
  ocdbt, plain = written
  listing = orbax_metadata.read_listing(str(plain / "items"))
  assert not listing.use_ocdbt and not listing.use_zarr3
  assert listing.leaves == orbax_metadata.read_leaves(str(ocdbt))


def test_listing_reads_no_array_data(tmp_path):
  ckpt = _copy(tmp_path)
  data_dir = ckpt / "0" / "items" / "ocdbt.process_0" / "d"
  biggest = max(data_dir.iterdir(), key=lambda p: p.stat().st_size)
  assert biggest.stat().st_size > 4_000_000
  biggest.unlink()  # the array chunks: listing must not need them
  assert len(orbax_metadata.read_leaves(str(ckpt))) == 54


@pytest.mark.parametrize("parts, folded", [
    (("params", "params", "decoder", "w"), ("params", "params", "decoder", "w")),
    (("decoder", "layers", 0, "w"), ("decoder", "layers_0", "w")),
    (("opt_state", "0", "mu"), ("opt_state_0", "mu")),
    (("a", 1, 2), ("a_1_2",)),
    (("decoder", "scale", "value"), ("decoder", "scale")),
    (("value",), ("value",)),
])
def test_fold_key_follows_maxtext(parts, folded):
  assert orbax_metadata.fold_key(parts) == folded


def _one_line(excinfo):
  assert "\n" not in str(excinfo.value)
  return str(excinfo.value)


def test_missing_path_and_non_checkpoint_paths(tmp_path):
  with pytest.raises(errors.CheckpointError, match="checkpoint path does not exist") as e:
    orbax_metadata.read_leaves(str(tmp_path / "nope"))
  _one_line(e)
  with pytest.raises(errors.CheckpointError, match="not an Orbax checkpoint: .*expected an Orbax step directory"):
    orbax_metadata.read_leaves(str(tmp_path))
  (tmp_path / "f.txt").write_text("x")
  with pytest.raises(errors.CheckpointError, match="a file, not a directory"):
    orbax_metadata.read_leaves(str(tmp_path / "f.txt"))


@pytest.mark.parametrize("content, message", [
    (None, "truncated JSON"),
    ("", "empty file"),
    ("[1, 2]", "no 'tree_metadata' object"),
    ('{"tree_metadata": {"x": {"value_metadata": {}}}}', "entry x lacks 'key_metadata'"),
    ("{'not': json}", "not valid JSON"),
])
def test_corrupt_tree_metadata_is_one_line_error(tmp_path, content, message):
  ckpt = _copy(tmp_path)
  meta = ckpt / "0" / "items" / "_METADATA"
  meta.write_text(meta.read_text()[:2000] if content is None else content)
  with pytest.raises(errors.CheckpointError, match=message) as e:
    orbax_metadata.read_leaves(str(ckpt))
  assert "_METADATA: corrupt Orbax metadata" in _one_line(e)


def test_items_without_tree_metadata_is_incomplete(tmp_path):
  ckpt = _copy(tmp_path)
  (ckpt / "0" / "items" / "_METADATA").unlink()
  with pytest.raises(errors.CheckpointError, match=r"items: Orbax tree metadata _METADATA is missing") as e:
    orbax_metadata.read_leaves(str(ckpt / "0"))
  _one_line(e)


def test_missing_or_truncated_ocdbt_manifest(tmp_path):
  ckpt = _copy(tmp_path)
  manifest = ckpt / "0" / "items" / "manifest.ocdbt"
  manifest.write_bytes(manifest.read_bytes()[:50])
  with pytest.raises(errors.CheckpointError, match="cannot read the array metadata .*Error decoding manifest") as e:
    orbax_metadata.read_leaves(str(ckpt))
  _one_line(e)
  manifest.unlink()
  with pytest.raises(errors.CheckpointError, match="manifest.ocdbt is missing"):
    orbax_metadata.read_leaves(str(ckpt))


def test_entry_without_array_header_is_reported(tmp_path):
  ckpt = _copy(tmp_path)
  meta_path = ckpt / "0" / "items" / "_METADATA"
  meta = json.loads(meta_path.read_text())
  meta["tree_metadata"]["('params', 'ghost')"] = {
      "key_metadata": [{"key": "params", "key_type": 2}, {"key": "ghost", "key_type": 2}],
      "value_metadata": {"value_type": "jax.Array", "skip_deserialize": False}}
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(errors.CheckpointError, match="array metadata missing for params.ghost"):
    orbax_metadata.read_leaves(str(ckpt))


def test_listing_imports_neither_jax_nor_orbax():
  code = ("import sys; from inspect_tool.checkpoint import orbax_metadata as m; m.read_leaves(sys.argv[1]); "
          "print(sorted(k for k in ('jax', 'orbax', 'flax', 'orbax.checkpoint') if k in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code, REF_CKPT], check=True, capture_output=True, text=True)
  assert out.stdout.strip() == "[]"


def test_step_with_another_checkpointable_name(tmp_path):
  step = tmp_path / "4"
  shutil.copytree(os.path.join(REF_CKPT, "0"), step)
  os.rename(step / "items", step / "state")
  resolved = locate.resolve_orbax_path(str(step))
  assert resolved.items_dir == str(step / "state") and resolved.note == "using checkpointable 'state' (no 'items')"
  shutil.copytree(step / "state", step / "other")
  with pytest.raises(errors.CheckpointError, match=r"several checkpointables \(other, state\) and none named 'items'"):
    locate.resolve_orbax_path(str(step))
