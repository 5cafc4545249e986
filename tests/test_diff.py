"""Tests for inspect_tool.checkpoint.diff: model/checkpoint leaf comparison and recognised causes."""

import json
import os

import pytest

from inspect_tool.paramtree import tree
from inspect_tool.checkpoint import diff
from inspect_tool.checkpoint import orbax_metadata

import maxtext_listings
from conftest import DATA

REF_CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")


@pytest.fixture(scope="module")
def ckpt():
  """The reference checkpoint's params (converter layout: gate biases under params/params)."""
  return [l for l in orbax_metadata.read_leaves(REF_CKPT) if l.is_param]


def _as_model(leaves):
  """The NNX model's view: the DeepSeek-V3 gate biases are MoEBiasVar, keyed under nnx_aux/model."""
  return [tree.Leaf(tree.aux_key(l.module_path), l.shape, l.dtype) if l.key[-2:] == ("gate", "bias") else l
          for l in leaves]


def _causes(result):
  return {c.kind: c.suggestion for c in result.causes}


def _maxtext_unscanned():
  """MaxText's own unscanned tree of the reference checkpoint's model (its listing: Params only)."""
  return [tree.Leaf(tuple(key.split(".")), shape, dtype)
          for key, shape, dtype in sorted(maxtext_listings.entries("deepseek3-tiny-L4-V1024_noscan_mtp1.txt"))]


def test_model_agrees_with_its_checkpoint_through_the_gate_bias_alias(ckpt):
  result = diff.diff_leaves(_as_model(ckpt), ckpt)
  assert result.agree and result.loadable and not result.causes
  assert len(result.matched) == 53
  assert sorted(p.model.dotted for p in result.aliased) == [
      "nnx_aux.model.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias",
      "nnx_aux.model.mtp_block.mtp_layer_1.mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"]
  assert result.summary() == "model and checkpoint agree (53 weights)"
  as_json = json.loads(json.dumps(result.to_dict()))
  assert as_json["agree"] is True and as_json["matched"] == 53 and len(as_json["aliased"]) == 2


def test_training_only_items_are_ignored(ckpt):
  extra = [tree.Leaf(("opt_state_0", "mu", "params", "x"), (2,), "float32"), tree.Leaf(("step",), (), "int32"),
           tree.Leaf(tree.aux_key(("decoder", "rngs", "params", "key")), (), "uint32")]
  result = diff.diff_leaves(_as_model(ckpt), ckpt + extra)
  assert result.agree and len(result.ignored) == 3


def test_unscanned_checkpoint_for_scanned_model_suggests_scan_layers_false(ckpt):
  result = diff.diff_leaves(_as_model(ckpt), _maxtext_unscanned())
  assert not result.agree
  assert _causes(result) == {"scan_layers": "scan_layers=false"}
  assert "params.params.decoder.moe_layers_0.self_attention.wq_a.kernel" in {l.dotted for l in result.unexpected}
  assert result.summary().endswith("; try scan_layers=false")


def test_scanned_checkpoint_for_unscanned_model_suggests_scan_layers_true(ckpt):
  assert _causes(diff.diff_leaves(_maxtext_unscanned(), ckpt)) == {"scan_layers": "scan_layers=true"}


def test_mtp_in_checkpoint_but_not_in_model_and_vice_versa(ckpt):
  no_mtp = [l for l in ckpt if "mtp_block" not in l.key]
  result = diff.diff_leaves(_as_model(no_mtp), ckpt)
  assert result.loadable and not result.agree
  assert _causes(result) == {"mtp_num_layers": "mtp_num_layers=1"}
  result = diff.diff_leaves(_as_model(ckpt), no_mtp)
  assert _causes(result) == {"mtp_num_layers": "mtp_num_layers=0"} and len(result.missing) == 21


def test_layer_axis_at_the_other_position_suggests_param_scan_axis(ckpt):
  swapped = [tree.Leaf(l.key, (l.shape[1], l.shape[0]) + l.shape[2:], l.dtype)
             if any(p in l.key for p in ("dense_layers", "moe_layers")) and l.key[-1] != "bias" else l for l in ckpt]
  result = diff.diff_leaves(_as_model(ckpt), swapped)
  assert not result.loadable and len(result.shape_mismatches) == 28
  assert _causes(result) == {"param_scan_axis": "param_scan_axis=0"}


def test_vocab_size_mismatch_names_the_key(ckpt):
  bigger = [tree.Leaf(l.key, (2048, 64) if l.key[-1] == "embedding" else (64, 2048), l.dtype)
            if l.key[-1] == "embedding" or l.key[-2:] == ("logits_dense", "kernel") else l for l in ckpt]
  result = diff.diff_leaves(_as_model(ckpt), bigger)
  vocab = [c for c in result.causes if c.kind == "vocab_size"]
  assert [c.suggestion for c in vocab] == ["vocab_size=2048"]
  assert vocab[0].message == ("params.params.decoder.logits_dense.kernel: vocabulary 2048 in the checkpoint, "
                              "1024 in the model")
  assert _causes(result) == {"vocab_size": "vocab_size=2048"}


def test_different_layer_count_suggests_the_layer_keys(ckpt):
  five = [tree.Leaf(l.key, l.shape[:1] + (5,) + l.shape[2:], l.dtype)
          if "moe_layers" in l.key and l.key[-1] != "bias" and len(l.shape) >= 2 else l for l in ckpt]
  result = diff.diff_leaves(_as_model(ckpt), five)
  assert _causes(result) == {"num_layers": "base_num_decoder_layers=6"}


def test_dtype_mismatch_suggests_weight_dtype(ckpt):
  bf16 = [tree.Leaf(l.key, l.shape, "bfloat16") for l in ckpt]
  result = diff.diff_leaves(_as_model(ckpt), bf16)
  assert len(result.dtype_mismatches) == 53 and not result.shape_mismatches
  assert _causes(result) == {"weight_dtype": "weight_dtype=bfloat16"}


def test_checkpoint_of_another_model_has_nothing_in_common(ckpt):
  hf = [tree.Leaf(("model", "embed_tokens", "weight"), (1024, 64), "bfloat16"),
        tree.Leaf(("lm_head", "weight"), (1024, 64), "bfloat16")]
  result = diff.diff_leaves(_as_model(ckpt), hf)
  assert len(result.missing) == 53 and len(result.unexpected) == 2
  (cause,) = result.causes
  assert cause.kind == "unrelated" and "Hugging Face" in cause.message


def test_quantized_keys_compare_like_any_other(ckpt):
  kernel = tree.param_key(("decoder", "dense_layers", "mlp", "wi_0", "kernel"))
  quantized = [l for l in ckpt if l.key != kernel] + [
      tree.Leaf(kernel + ("array", "qvalue"), (64, 1, 64), "float8_e4m3fn"),
      tree.Leaf(kernel + ("array", "scale"), (1, 1, 64), "float32")]
  assert diff.diff_leaves(_as_model(quantized), quantized).agree
  result = diff.diff_leaves(_as_model(ckpt), quantized)
  assert [l.dotted for l in result.missing] == ["params.params.decoder.dense_layers.mlp.wi_0.kernel"]
  assert "quantization" in _causes(result)
  result = diff.diff_leaves(_as_model(quantized), ckpt)
  assert "quantization" in _causes(result) and len(result.missing) == 2


def test_summary_lists_first_three_keys_and_the_count(ckpt):
  model = _as_model(ckpt) + [tree.Leaf(tree.param_key(("decoder", f"extra_{i}")), (1,), "float32") for i in range(5)]
  text = diff.diff_leaves(model, ckpt).summary()
  assert text == ("5 missing from checkpoint (params.params.decoder.extra_0, params.params.decoder.extra_1, "
                  "params.params.decoder.extra_2, +2 more)")
