"""The model's parameter tree against MaxText 0.2.5: names, shapes, dtypes, totals, variable kinds."""

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from inspect_tool.configuration import config
from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.paramtree import params
from inspect_tool.paramtree import tree
from inspect_tool.model import moe

import maxtext_listings

L4 = ["override_model_config=true", "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024"]


def _cfg(*tokens):
  return config.resolve_config(list(tokens))


def _leaves(cfg, **kw):
  return params.param_leaves(model_lib.build_model(cfg), **kw)


def _as_set(leaves):
  return {(leaf.dotted, leaf.shape, leaf.dtype) for leaf in leaves}


def _by_key(leaves):
  return {leaf.dotted: leaf.shape for leaf in leaves}


# Totals: the `Total Parameters` MaxText printed for each listing (tests/data/listings/README.md).
@pytest.mark.parametrize("listing, total", [
    ("deepseek3-671b_scan_mtp1.txt", 682636472320),
    ("deepseek3-671b_noscan_mtp1.txt", 682636472320),
    ("deepseek3-test_scan_mtp1.txt", 16118181888),
    ("deepseek3-tiny_scan_mtp1.txt", 34004896),
    ("deepseek3-tiny_noscan_mtp1.txt", 34004896),
    ("deepseek3-tiny-L4-V1024_scan_mtp1.txt", 1396848),
    ("deepseek3-tiny-L4-V1024_noscan_mtp1.txt", 1396848),
    ("deepseek3-tiny-L4-V1024-scanaxis0_scan_mtp1.txt", 1396848),
    ("deepseek2-16b_scan_mtp0.txt", 15706484224),
    ("deepseek2-16b_noscan_mtp0.txt", 15706484224),
])
def test_param_tree_equals_maxtext_listing(listing, total):
  """Names, shapes and dtypes of every Param, built from the keys of MaxText's own command line."""
  leaves = _leaves(_cfg(*maxtext_listings.model_keys(listing)))
  assert _as_set(leaves) == maxtext_listings.entries(listing)
  assert len(leaves) == len(maxtext_listings.entries(listing))
  assert sum(leaf.size for leaf in leaves) == total


def test_listing_keys_are_read_from_maxtexts_command_line():
  assert maxtext_listings.model_keys("deepseek3-671b_noscan_mtp1.txt") == [
      "model_name=deepseek3-671b", "scan_layers=false", "mtp_num_layers=1"]
  assert maxtext_listings.model_keys("deepseek3-tiny-L4-V1024_scan_mtp1.txt") == [
      "model_name=deepseek3-tiny", "mtp_num_layers=1"] + L4


def test_671b_without_mtp_has_maxtexts_total_and_no_mtp_keys():
  leaves = _leaves(_cfg("model_name=deepseek3-671b"))
  assert sum(leaf.size for leaf in leaves) == 671026404352
  assert not [leaf for leaf in leaves if "mtp_block" in leaf.key]


def test_unscanned_gate_bias_is_per_layer_moebiasvar():
  listing = "deepseek3-tiny-L4-V1024_noscan_mtp1.txt"
  leaves = _leaves(_cfg(*maxtext_listings.model_keys(listing)), include_non_params=True)
  assert _as_set(l for l in leaves if l.is_param) == maxtext_listings.entries(listing)
  biases = {leaf.dotted: leaf.shape for leaf in leaves if leaf.key[-1] == "bias"}
  mtp = "nnx_aux.model.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"
  assert biases == {f"nnx_aux.model.decoder.moe_layers_{j}.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias": (16,)
                    for j in range(3)} | {mtp: (16,)}


def test_deepseek2_has_no_gate_bias_and_no_non_param_state():
  """Shapes are checked against MaxText's deepseek2-16b listings above; MaxText lists Params only, so this checks
  that the model has nothing else (no DeepSeek-V3 gate bias) and no V3-only keys."""
  leaves = _leaves(_cfg("model_name=deepseek2-16b"), include_non_params=True)
  assert all(leaf.is_param for leaf in leaves)
  assert not [l for l in leaves if "wq_a" in l.key or "q_norm" in l.key or l.key[-1] == "bias"]


def test_param_scan_axis_zero_keeps_the_gate_bias_layer_axis_at_zero():
  """Params with param_scan_axis=0 are checked against MaxText's listing above; the gate bias (not a Param, not in
  the listing) keeps its layer axis at 0 either way."""
  keys = _by_key(_leaves(_cfg("model_name=deepseek3-tiny", "param_scan_axis=0", *L4), include_non_params=True))
  assert keys["params.params.decoder.moe_layers.self_attention.wq_b.kernel"] == (3, 32, 4, 192)
  assert keys["nnx_aux.model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"] == (3, 16)


def test_deepseek3_gate_bias_is_moebiasvar_at_layer_axis_zero_and_not_a_param():
  cfg = _cfg("model_name=deepseek3-tiny", "mtp_num_layers=1")
  model = model_lib.build_model(cfg)
  gate = model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate
  assert type(gate.bias) is moe.MoEBiasVar and not isinstance(gate.bias, nnx.Param)
  keys = _by_key(params.param_leaves(model, include_non_params=True))
  assert keys["nnx_aux.model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"] == (58, 16)
  mtp_bias = "nnx_aux.model.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"
  assert keys[mtp_bias] == (16,)
  assert not [k for k in _by_key(params.param_leaves(model)) if k.endswith("bias")]


def test_other_model_names_with_routed_bias_keep_the_bias_as_a_param_at_axis_one():
  cfg = _cfg("model_name=deepseek3-tiny", *L4).replace(model_name="my-deepseek")
  keys = _by_key(_leaves(cfg, include_non_params=True))
  assert keys["params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"] == (16, 3)
  assert not [k for k in keys if k.startswith("nnx_aux")]
  no_bias = _by_key(_leaves(cfg.replace(routed_bias=False), include_non_params=True))
  assert not [k for k in no_bias if k.endswith("bias")]


def test_module_attributes_mirror_maxtext_and_mtp_shares_the_decoder():
  model = model_lib.build_model(_cfg("model_name=deepseek3-tiny", "mtp_num_layers=1", *L4))
  attention = model.decoder.moe_layers.self_attention
  for name in ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "out", "attention_op", "rotary_embedding"):
    assert isinstance(getattr(attention, name), nnx.Module), name
  assert not nnx.state(attention.attention_op) and not nnx.state(attention.rotary_embedding)
  assert model.mtp_block.decoder is model.decoder
  paths = [tuple(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model))]
  assert not [p for p in paths if p[:2] == ("mtp_block", "decoder") or "rngs" in p]
  assert not [v for _, v in nnx.to_flat_state(nnx.state(model)) if isinstance(v, nnx.RngState)]


def test_abstract_build_allocates_nothing():
  model = model_lib.build_model(_cfg("model_name=deepseek3-671b", "mtp_num_layers=1"))
  values = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model))]
  assert values and all(isinstance(v, jax.ShapeDtypeStruct) for v in values)


def test_real_build_is_seeded_and_uses_maxtext_init_families():
  cfg = _cfg("model_name=deepseek3-tiny", "mtp_num_layers=1", *L4)
  model = model_lib.build_model(cfg, abstract=False, seed=3)
  assert _as_set(params.param_leaves(model)) == maxtext_listings.entries("deepseek3-tiny-L4-V1024_scan_mtp1.txt")
  block = model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0
  assert np.all(np.asarray(block.gate.bias[...]) == 0)
  assert np.all(np.asarray(model.decoder.decoder_norm.scale[...]) == 1)
  wi_0 = np.asarray(block.wi_0[...])
  assert wi_0.dtype == np.float32 and abs(wi_0.std() - 1 / 8) < 0.01  # variance 1/fan_in (E=64)
  assert np.abs(wi_0).max() <= 2 / 8 / 0.87962566103423978 + 1e-6  # truncated at two standard deviations
  assert not np.array_equal(wi_0[:, 0], wi_0[:, 1])  # layers differ
  again = model_lib.build_model(cfg, abstract=False, seed=3)
  np.testing.assert_array_equal(np.asarray(again.token_embedder.embedding[...]),
                                np.asarray(model.token_embedder.embedding[...]))


def _arrays_for(model):
  return {leaf.key: np.zeros(leaf.shape, leaf.dtype) for leaf in params.param_leaves(model, include_non_params=True)}


def test_assign_arrays_fills_an_abstract_model_and_returns_unused_keys():
  model = model_lib.build_model(_cfg("model_name=deepseek3-tiny", "mtp_num_layers=1", *L4))
  arrays = _arrays_for(model)
  bias_key = tree.aux_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"))
  arrays[tree.param_key(bias_key[2:])] = np.full((3, 16), 0.5, np.float32)  # converter layout alias
  del arrays[bias_key]
  arrays[("nnx_aux", "model", "decoder", "rngs", "params", "key")] = np.zeros((), np.uint32)
  unused = params.assign_arrays(model, arrays)
  assert unused == [("nnx_aux", "model", "decoder", "rngs", "params", "key")]
  bias = model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias[...]
  assert isinstance(bias, jax.Array) and float(bias[0, 0]) == 0.5
  assert all(isinstance(v.get_value(), jax.Array) for _, v in nnx.to_flat_state(nnx.state(model)))


def test_assign_arrays_names_every_missing_and_misshaped_weight_and_writes_nothing():
  model = model_lib.build_model(_cfg("model_name=deepseek3-tiny", "mtp_num_layers=1", *L4))
  arrays = _arrays_for(model)
  del arrays[("params", "params", "decoder", "decoder_norm", "scale")]
  del arrays[tree.aux_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"))]
  arrays[("params", "params", "token_embedder", "embedding")] = np.zeros((1000, 64), np.float32)
  with pytest.raises(errors.MismatchError) as info:
    params.assign_arrays(model, arrays)
  message = str(info.value)
  assert "\n" not in message and "missing 2" in message and "mis-shaped 1" in message
  assert "params.params.decoder.decoder_norm.scale" in message
  assert "nnx_aux.model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias" in message
  assert "params.params.token_embedder.embedding (1000, 64) (model: (1024, 64))" in message
  assert isinstance(model.token_embedder.embedding.get_value(), jax.ShapeDtypeStruct)


def test_assign_arrays_casts_to_the_model_dtype():
  cfg = _cfg("model_name=deepseek3-tiny", "weight_dtype=bfloat16", *L4)
  model = model_lib.build_model(cfg)
  arrays = {k: v.astype(np.float32) for k, v in _arrays_for(model).items()}
  params.assign_arrays(model, arrays)
  assert model.token_embedder.embedding[...].dtype == jnp.bfloat16
