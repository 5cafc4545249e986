"""Tests for inspect_tool.checkpoint.restore: reading real weights by Leaf key onto a device mesh."""

import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inspect_tool import errors
from inspect_tool.paramtree import tree
from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.checkpoint import restore

from conftest import DATA
REF_CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
GATE = ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")
WI_0 = ("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0")
NORM = ("decoder", "decoder_norm", "scale")


def _ref_leaf(key):
  return next(l for l in orbax_metadata.read_leaves(REF_CKPT) if l.key == key)


def test_restores_only_the_requested_keys_with_values_and_sharding():
  leaves = [_ref_leaf(tree.param_key(NORM)), _ref_leaf(tree.param_key(WI_0))]
  arrays = restore.restore_leaves(REF_CKPT, leaves)
  assert set(arrays) == {tree.param_key(NORM), tree.param_key(WI_0)}
  norm, wi_0 = arrays[tree.param_key(NORM)], arrays[tree.param_key(WI_0)]
  assert isinstance(norm, jax.Array) and norm.shape == (64,) and norm.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(norm), np.ones(64, np.float32))  # RMSNorm scales start at one
  assert wi_0.shape == (16, 3, 64, 64) and float(jnp.std(wi_0)) > 0.01
  assert isinstance(wi_0.sharding, jax.sharding.NamedSharding)


def test_gate_bias_asked_under_nnx_aux_is_read_from_params_in_converter_layout():
  stored = _ref_leaf(tree.param_key(GATE))
  wanted = tree.Leaf(tree.aux_key(GATE), stored.shape, stored.dtype)
  via_alias = restore.restore_leaves(REF_CKPT, [wanted])[tree.aux_key(GATE)]
  direct = restore.restore_leaves(REF_CKPT, [stored])[tree.param_key(GATE)]
  assert via_alias.shape == (3, 16)
  np.testing.assert_array_equal(np.asarray(via_alias), np.asarray(direct))


def test_rng_state_is_never_requested():
  rng = tree.Leaf(tree.aux_key(("decoder", "rngs", "params", "count")), (), "uint32")
  assert restore.restore_leaves(REF_CKPT, [rng, _ref_leaf(tree.param_key(NORM))]).keys() == {tree.param_key(NORM)}


def test_missing_and_misshaped_weights_raise_one_mismatch_line():
  leaves = [tree.Leaf(tree.param_key(("decoder", f"ghost_{i}", "kernel")), (2,), "float32") for i in range(5)]
  leaves.append(tree.Leaf(tree.param_key(NORM), (32,), "float32"))
  leaves.append(tree.Leaf(tree.param_key(WI_0), (16, 3, 64, 64), "bfloat16"))
  with pytest.raises(errors.MismatchError) as e:
    restore.restore_leaves(REF_CKPT, leaves)
  text = str(e.value)
  assert "\n" not in text
  assert "does not fit the model: 5 missing from checkpoint (params.params.decoder.ghost_0.kernel" in text
  assert "+2 more" in text
  assert "1 shape mismatch(es) (params.params.decoder.decoder_norm.scale model (32,) vs checkpoint (64,))" in text
  assert "1 dtype mismatch(es) (params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0 model " \
         "bfloat16 vs checkpoint float32)" in text


def test_deleted_array_data_file_is_reported_at_restore_time(tmp_path):
  ckpt = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, ckpt)
  data_dir = ckpt / "0" / "items" / "ocdbt.process_0" / "d"
  os.chmod(data_dir, 0o755)
  max(data_dir.iterdir(), key=lambda p: p.stat().st_size).unlink()
  leaves = [_ref_leaf(tree.param_key(WI_0))]
  with pytest.raises(errors.CheckpointError) as e:
    restore.restore_leaves(str(ckpt), leaves)
  text = str(e.value)
  assert "\n" not in text
  assert "cannot read the data of params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0" in text
  assert "missing, truncated or corrupt" in text


def test_training_layout_reads_params_and_nnx_aux_and_skips_optimizer(tmp_path):
  import orbax.checkpoint.experimental.v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  kernel = jnp.arange(12, dtype=jnp.float32).reshape(4, 3)
  bias = jnp.array([1.0, 2.0, 3.0], jnp.float32)
  state = {
      "params": {"params": {"decoder": {"dense": {"kernel": kernel}}}},
      "nnx_aux": {"model": {"decoder": {"gate": {"bias": bias},
                                        "rngs": {"params": {"count": jnp.zeros((), jnp.uint32)}}}}},
      "opt_state": [{"count": jnp.zeros((), jnp.int32), "mu": {"params": {"decoder": {"dense": {"kernel": kernel}}}}}],
      "step": jnp.int32(3),
  }
  ocp_v1.save(str(tmp_path / "3"), state, checkpointable_name="items")
  leaves = [tree.Leaf(tree.param_key(("decoder", "dense", "kernel")), (4, 3), "float32"),
            tree.Leaf(tree.aux_key(("decoder", "gate", "bias")), (3,), "float32")]
  arrays = restore.restore_leaves(str(tmp_path), leaves)
  np.testing.assert_array_equal(np.asarray(arrays[leaves[0].key]), np.asarray(kernel))
  np.testing.assert_array_equal(np.asarray(arrays[leaves[1].key]), np.asarray(bias))


def test_array_sharding_picks_the_largest_divisible_dimension():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  assert restore.array_sharding((8, 4), mesh).spec == jax.sharding.PartitionSpec()


_SHARDED = r"""
import sys
import jax
from inspect_tool.paramtree import tree
from inspect_tool.checkpoint import orbax_metadata, restore
assert jax.device_count() == 4, jax.devices()
mesh = restore.default_mesh()
assert restore.array_sharding((3, 5), mesh).spec == jax.sharding.PartitionSpec()
assert restore.array_sharding((6, 8, 8), mesh).spec == jax.sharding.PartitionSpec(None, "devices", None)
leaves = [l for l in orbax_metadata.read_leaves(sys.argv[1]) if l.is_param]
arrays = restore.restore_leaves(sys.argv[1], leaves, mesh=mesh)
wi_0 = arrays[tree.param_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0"))]
print(len(arrays), tuple(wi_0.sharding.spec), sorted({s.data.shape for s in wi_0.addressable_shards}),
      len({s.device for s in wi_0.addressable_shards}))
emb = arrays[tree.param_key(("token_embedder", "embedding"))]
print(tuple(emb.sharding.spec), emb.addressable_shards[0].data.shape)
"""


def test_restore_shards_the_largest_dimension_over_four_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _SHARDED, REF_CKPT], capture_output=True, text=True, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == [
      "53 (None, None, 'devices', None) [(16, 3, 16, 64)] 4",
      "('devices', None) (256, 64)",
  ]


# Integration with the NNX model (inspect_tool.model / inspect_tool.paramtree.params).
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]


def _model(*extra):
  from inspect_tool import model  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  return model.build_model(config.resolve_config(TINY + list(extra)), abstract=True)


def _stored(name):
  """An array of the reference checkpoint read with tensorstore alone (independent of restore)."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  items = os.path.abspath(os.path.join(REF_CKPT, "0", "items"))
  spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/"}, "path": name + "/"}
  return ts.open(spec).result().read().result()


def test_load_reference_checkpoint_into_the_tiny_model():
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel
  model = restore.load_checkpoint(_model(), REF_CKPT)
  moe = model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0
  np.testing.assert_array_equal(np.asarray(moe.wi_0.get_value()),
                                _stored("params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"))
  np.testing.assert_array_equal(np.asarray(moe.gate.bias.get_value()),
                                _stored("params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"))
  np.testing.assert_array_equal(np.asarray(model.token_embedder.embedding.get_value()),
                                _stored("params.params.token_embedder.embedding"))
  leaves = params.param_leaves(model, include_non_params=True)
  assert len(leaves) == 53


def test_load_training_layout_into_an_unscanned_model(tmp_path):
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import orbax.checkpoint.experimental.v1 as ocp_v1  # pylint: disable=import-outside-toplevel
  from inspect_tool.paramtree import params  # pylint: disable=import-outside-toplevel
  model = _model("scan_layers=false")
  leaves = params.param_leaves(model, include_non_params=True)
  assert any(l.key[:2] == tree.AUX_PREFIX for l in leaves)
  rng = np.random.default_rng(0)
  values, state = {}, {"opt_state": [{"count": jnp.zeros((), jnp.int32)}, None], "step": jnp.int32(5)}
  for leaf in leaves:
    values[leaf.key] = rng.standard_normal(leaf.shape).astype(leaf.dtype)
    node = state
    for part in leaf.key[:-1]:
      node = node.setdefault(part, {})
    node[leaf.key[-1]] = jnp.asarray(values[leaf.key])
  state["nnx_aux"]["model"]["decoder"]["rngs"] = {"params": {"count": jnp.zeros((), jnp.uint32)}}
  ocp_v1.save(str(tmp_path / "5"), state, checkpointable_name="items")
  loaded = restore.load_checkpoint(_model("scan_layers=false"), str(tmp_path))
  bias = loaded.decoder.moe_layers_2.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias.get_value()
  np.testing.assert_array_equal(
      np.asarray(bias), values[tree.aux_key(("decoder", "moe_layers_2", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate",
                                             "bias"))])
  np.testing.assert_array_equal(np.asarray(loaded.decoder.dense_layers_0.mlp.wo.kernel.get_value()),
                                values[tree.param_key(("decoder", "dense_layers_0", "mlp", "wo", "kernel"))])


def test_scanned_checkpoint_into_unscanned_model_names_weights_and_suggests_scan_layers():
  with pytest.raises(errors.MismatchError) as e:
    restore.load_checkpoint(_model("scan_layers=false"), REF_CKPT)
  text = str(e.value)
  assert "\n" not in text and text.endswith("; try scan_layers=true")
  assert "does not fit the model: 63 missing from checkpoint (nnx_aux.model.decoder.moe_layers_0." in text


def test_checkpoint_of_another_vocabulary_names_the_key():
  with pytest.raises(errors.MismatchError, match=r"params.params.decoder.logits_dense.kernel model \(64, 2048\) vs "
                     r"checkpoint \(64, 1024\).*try vocab_size=1024$"):
    restore.load_checkpoint(_model("vocab_size=2048"), REF_CKPT)
