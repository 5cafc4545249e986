"""DeepSeek-V3.2 (`deepseek3.2-671b`): the lightning indexer's tree, forward pass, Qwix coverage and FP8 export,
against MaxText 0.2.5's listings and its forward pass on a small MaxText-written checkpoint (`ckpt_v32-small`)."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import orbax_sources

import maxtext_listings

from inspect_tool.configuration import config
from inspect_tool.coverage import trace as coverage
from inspect_tool import errors
from inspect_tool.run import forward
from inspect_tool import model as model_lib
from inspect_tool.paramtree import params
from inspect_tool.run import runner as running
from inspect_tool.model import indexer

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR)
CKPT = DATA / "ckpt_v32-small"
SMALL = ["model_name=deepseek3.2-671b", "override_model_config=true", "mtp_num_layers=1", "base_emb_dim=64",
         "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "base_moe_mlp_dim=32",
         "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=512", "num_experts=8",
         "num_experts_per_tok=2", "q_lora_rank=32", "kv_lora_rank=16", "qk_nope_head_dim=32", "qk_rope_head_dim=16",
         "v_head_dim=32", "indexer_n_heads=4", "indexer_head_dim=32", "indexer_topk=8"]
INDEXER = "params.params.decoder.moe_layers.self_attention.indexer"



def _leaves(tokens, **kw):
  return params.param_leaves(model_lib.build_model(config.resolve_config(tokens)), **kw)


def _rel(ours, golden):
  ours, golden = np.asarray(ours, np.float64), np.asarray(golden, np.float64)
  return float(np.linalg.norm(ours - golden) / np.linalg.norm(golden))


@pytest.mark.parametrize("listing, tokens, total", [
    ("deepseek3.2-671b_scan_mtp1.txt", ["model_name=deepseek3.2-671b", "mtp_num_layers=1"],
     683501956608),
    ("../ckpt_v32-small/listing.txt", SMALL, 382656),
    ("deepseek3.2-671b_noscan_mtp1.txt",
     ["model_name=deepseek3.2-671b", "mtp_num_layers=1", "scan_layers=false"], 683501956608),
])
def test_param_tree_equals_maxtext_listing(listing, tokens, total):
  leaves = _leaves(tokens)
  assert {(leaf.dotted, leaf.shape, leaf.dtype) for leaf in leaves} == maxtext_listings.entries(listing)
  assert sum(leaf.size for leaf in leaves) == total


def test_unscanned_indexer_is_per_layer_and_float32_where_maxtext_keeps_it():
  keys = {leaf.dotted: (leaf.shape, leaf.dtype)
          for leaf in _leaves(SMALL + ["scan_layers=false", "weight_dtype=bfloat16"])}
  for layer in ("dense_layers_0", "moe_layers_0", "moe_layers_1"):
    prefix = f"params.params.decoder.{layer}.self_attention.indexer"
    assert keys[f"{prefix}.wq_b.kernel"] == ((32, 4, 32), "bfloat16")
    assert keys[f"{prefix}.wk.kernel"] == ((64, 32), "bfloat16")
    assert keys[f"{prefix}.weights_proj.kernel"] == ((64, 4), "float32")  # MaxText forces float32
    assert keys[f"{prefix}.k_norm.scale"] == ((32,), "float32")
    assert keys[f"{prefix}.k_norm.bias"] == ((32,), "float32")


def test_indexer_needs_the_query_latent():
  with pytest.raises(errors.ConfigError, match="use_indexer=true needs q_lora_rank > 0"):
    config.resolve_config(SMALL + ["q_lora_rank=0"])


def _reference_keep(score, k):
  """Numpy: the k largest of each row, ties broken by position (a stable sort of -score)."""
  order = np.argsort(-score, axis=-1, kind="stable")[..., :k]
  keep = np.zeros(score.shape, bool)
  np.put_along_axis(keep, order, True, axis=-1)
  return keep


def test_top_k_selection_breaks_ties_by_position_like_a_stable_sort():
  rng = np.random.default_rng(0)
  score = rng.integers(0, 5, size=(3, 7, 16)).astype(np.float32)  # many ties at every cut-off
  cutoff = np.sort(score, axis=-1)[..., ::-1][..., 5:6]
  keep = np.asarray(indexer.keep_top_k(jnp.asarray(score), jnp.asarray(cutoff), 6, exact=True))
  np.testing.assert_array_equal(keep, _reference_keep(score, 6))
  loose = np.asarray(indexer.keep_top_k(jnp.asarray(score), jnp.asarray(cutoff), 6, exact=False))
  np.testing.assert_array_equal(loose, score >= cutoff)
  assert loose.sum() > keep.sum()


@pytest.fixture(scope="module")
def arrays():
  restored = orbax_sources.restore_numpy(str(CKPT / "0" / "items"))
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {("params",) + tuple(str(k.key) for k in path): np.asarray(v) for path, v in flat}


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(CKPT / "golden_v32_a_noquant.npz"))


def _forward(tokens, arrays, g):
  cfg = config.resolve_config(tokens)
  model = model_lib.build_model(cfg)
  assert params.assign_arrays(model, arrays) == []
  model = running.quantize_for_training(model, cfg)  # unchanged without a quantization
  return forward.run_forward(model, g["tokens"], targets=g["targets"], target_mask=g["target_mask"],
                             positions=g["positions"], segment_ids=g["segment_ids"])


def test_forward_matches_maxtext_golden(arrays, golden):
  result = _forward(SMALL, arrays, golden)
  assert _rel(result.logits, golden["logits"]) <= 0.01
  assert int(np.sum(np.asarray(result.top1) == golden["top1"])) >= 31
  assert _rel(result.mtp_logits[0], golden["mtp_logits"]) <= 0.01
  assert int(np.sum(np.asarray(result.mtp_top1[0]) == golden["mtp_top1"])) >= 31
  np.testing.assert_allclose(np.asarray(result.mtp_losses), golden["mtp_losses__mtp_block__losses"], rtol=1e-3)


def test_fp8_full_forward_matches_maxtexts_quantized_forward(arrays, golden):
  """MaxText 0.2.5 under Qwix (quantization=fp8_full quantize_mtp=true, its model called op by op)."""
  reference = dict(np.load(CKPT / "maxtext_fp8full_mtptrue_op_by_op.npz"))
  result = _forward(SMALL + ["quantization=fp8_full", "quantize_mtp=true"], arrays, golden)
  assert _rel(result.logits, reference["logits"]) <= 1e-3
  assert _rel(reference["logits"], golden["logits"]) > 0.05  # the quantization is really there


def test_sparsity_matters_keeping_every_key_misses_the_golden(arrays, golden):
  """With topk=16 of 16 keys the indexer keeps everything: the golden (8 of 16) is then far away."""
  result = _forward([t for t in SMALL if not t.startswith("indexer_topk")] + ["indexer_topk=16"], arrays, golden)
  assert _rel(result.logits, golden["logits"]) > 0.1


def _ops(tokens):
  report = coverage.trace_coverage(config.resolve_config(tokens))
  return {(op.module, op.op): report.op_quantized(op) for op in report.ops}


def test_fp8_full_coverage_reaches_the_indexer_matmuls():
  ops = _ops(SMALL + ["quantization=fp8_full", "quantize_mtp=true"])
  for prefix in ("decoder/dense_layers/self_attention/indexer", "decoder/moe_layers/self_attention/indexer",
                 "mtp_block/mtp_layer_1/mtp_1_transformer_layer/self_attention/indexer"):
    for proj in ("wq_b", "wk", "weights_proj"):
      assert ops[(f"{prefix}/{proj}", "dot_general0")] is True
    assert ops[(prefix, "einsum0")] is False and ops[(prefix, "einsum1")] is False
    assert (prefix, "einsum2") not in ops


def test_short_sequences_skip_the_indexer_scoring_as_maxtext_does():
  """deepseek3.2-671b: max_target_length (2048) == indexer_topk, so MaxText's Qwix pass never scores keys."""
  ops = _ops(["model_name=deepseek3.2-671b", "quantization=fp8_full"])
  prefix = "decoder/moe_layers/self_attention/indexer"
  assert ops[(f"{prefix}/wq_b", "dot_general0")] and ops[(f"{prefix}/wk", "dot_general0")]
  assert (f"{prefix}/weights_proj", "dot_general0") not in ops and (prefix, "einsum0") not in ops
  longer = _ops(["model_name=deepseek3.2-671b", "quantization=fp8_full", "max_target_length=2049"])
  assert (f"{prefix}/weights_proj", "dot_general0") in longer and (prefix, "einsum1") in longer
