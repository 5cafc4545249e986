"""DeepSeek-V4 (`deepseek4-tiny`, `deepseek4-284b`): the tree against MaxText 0.2.5's listings, the forward pass
against MaxText's on its small checkpoint, MaxText's MTP refusal, the interleaved RoPE, and Qwix coverage."""

import pathlib

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import golden_parity
import maxtext_listings

from inspect_tool.configuration import config
from inspect_tool import errors
from inspect_tool.run import forward
from inspect_tool import model as model_lib
from inspect_tool.coverage import trace as coverage
from inspect_tool.paramtree import params
from inspect_tool.run import runner as running
from inspect_tool.paramtree import summary
from inspect_tool.coverage import plan
from inspect_tool.model import compressed_attention

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR)
SMALL = ["model_name=deepseek4-tiny", "override_model_config=true", "vocab_size=512"]
# jax 0.10 (the Python 3.11 stack) rounds some bf16 values differently from MaxText's jax 0.12: 0.4% relative error
# after layer 0, growing over the 43 mHC layers to 0.050 (jitted, vs the golden), 0.054 (op by op) and 0.246 (op by
# op, fp8_full), measured; the size of MaxText's own jit-vs-op-by-op differences (0.052, 0.24). MaxText's stack is
# held to its figures.
BOUNDS = ({"golden": 0.01, "op_by_op": 1e-3, "op_by_op_fp8": 1e-3} if golden_parity.GOLDEN_STACK else
          {"golden": 0.07, "op_by_op": 0.07, "op_by_op_fp8": 0.3})



@pytest.mark.parametrize("listing, tokens, total", [
    ("deepseek4-tiny_scan_mtp0.txt", ["model_name=deepseek4-tiny"], 27189331),
    ("deepseek4-tiny_noscan_mtp0.txt", ["model_name=deepseek4-tiny", "scan_layers=false"], 27189331),
    ("deepseek4-tiny-V512_scan_mtp0.txt", SMALL, 10707027),
    ("deepseek4-284b_scan_mtp0.txt", ["model_name=deepseek4-284b"], 284333639255),
])
def test_param_tree_equals_maxtext_listing(listing, tokens, total):
  leaves = params.param_leaves(model_lib.build_model(config.resolve_config(tokens)))
  assert {(leaf.dotted, leaf.shape, leaf.dtype) for leaf in leaves} == maxtext_listings.entries(listing)
  assert sum(leaf.size for leaf in leaves) == total


def test_hash_layers_hold_a_token_to_expert_table_outside_the_params():
  leaves = params.param_leaves(model_lib.build_model(config.resolve_config(SMALL)), include_non_params=True)
  tables = {leaf.dotted: leaf.shape for leaf in leaves if leaf.key[-1] == "tid2eid"}
  assert tables == {f"nnx_aux.model.decoder.layers_{i}.mlp.MoeBlock_0.tid2eid": (512, 4) for i in range(3)}
  biases = {leaf.dotted for leaf in leaves if leaf.key[-1] == "bias" and "gate" in leaf.key}
  assert biases == {f"nnx_aux.model.decoder.scanned_blocks.layers_{i}.mlp.MoeBlock_0.gate.bias" for i in (0, 1)}


def test_summary_names_the_v4_parts_and_counts_routed_experts_as_moe():
  leaves = params.param_leaves(model_lib.build_model(config.resolve_config(["model_name=deepseek4-tiny"])),
                               include_non_params=True)
  rows = {(r.group, r.part): r.params for r in summary.summarize(leaves, routed_fraction=0.25, all_leaves=True).rows}
  assert rows[("moe stack", "routed experts")] == 43 * 3 * 16 * 64 * 64
  assert rows[("moe stack", "hash routing tables")] == 3 * 129280 * 4
  assert rows[("moe stack", "mHC mixing")] == 43 * 2 * (256 + 2 * 256 * 4 + 256 * 16 + 3 + 4 + 4 + 16)
  assert rows[("moe stack", "indexer")] == 21 * (64 * 64 * 2 + 32 + 4 * 64 + 16 * 128 + 64 * 4)
  assert ("other", "") not in rows


def test_mtp_is_refused_with_maxtexts_reason():
  with pytest.raises(errors.ConfigError, match="DeepSeek4 decoder block currently does not support MTP layers"):
    config.resolve_config(["model_name=deepseek4-tiny", "mtp_num_layers=1"])
  with pytest.raises(errors.ConfigError, match="compress_ratio must be 0 \\(disabled\\) or >= 4"):
    config.resolve_config(SMALL + ["compress_ratios=[0,0,2]"])


def test_rope_rotates_interleaved_pairs_of_the_last_dims():
  rope = compressed_attention.V4Rope(4, 10_000.0)
  x = np.random.default_rng(0).normal(size=(1, 3, 2, 6)).astype(np.float32)
  positions = np.array([[0, 1, 5]])
  ours = np.asarray(rope(jnp.asarray(x), jnp.asarray(positions), -2))
  inv = 1 / 10_000.0 ** (np.arange(2) * 2 / 4)
  angle = positions[0][:, None, None] * inv  # [s, 1, pairs]
  pairs = x[0, :, :, 2:].reshape(3, 2, 2, 2)  # the last 4 dims as (x0, x1) pairs
  rotated = np.stack([pairs[..., 0] * np.cos(angle) - pairs[..., 1] * np.sin(angle),
                      pairs[..., 0] * np.sin(angle) + pairs[..., 1] * np.cos(angle)], axis=-1)
  np.testing.assert_allclose(ours[0, :, :, :2], x[0, :, :, :2])
  np.testing.assert_allclose(ours[0, :, :, 2:], rotated.reshape(3, 2, 4), rtol=1e-5, atol=1e-6)
  back = rope(jnp.asarray(ours), jnp.asarray(positions), -2, reverse=True)
  np.testing.assert_allclose(np.asarray(back), x, rtol=1e-5, atol=1e-5)


def _arrays():
  """MaxText's ckpt_v4-small (see tests/data/README.md): bf16 copies of the weights the model reads in bf16."""
  data = np.load(DATA / "ckpt_v4-small.npz")
  bf16 = set(data["__bfloat16_keys__"].tolist())
  out = {}
  for key in data.files:
    if key == "__bfloat16_keys__":
      continue
    value = data[key]
    value = value.view(ml_dtypes.bfloat16).astype(np.float32) if key in bf16 else value
    out[("params",) + tuple(key.split("/"))] = value
  return out


def test_forward_matches_maxtext_golden():
  golden = dict(np.load(DATA / "golden" / "v4_a_noquant.npz"))
  model = model_lib.build_model(config.resolve_config(SMALL))
  assert params.assign_arrays(model, _arrays()) == []
  result = forward.run_forward(model, golden["tokens"], targets=golden["targets"], target_mask=golden["target_mask"],
                               positions=golden["positions"], segment_ids=golden["segment_ids"])
  rel = np.linalg.norm(np.asarray(result.logits, np.float64) - golden["logits"]) / np.linalg.norm(golden["logits"])
  assert rel <= BOUNDS["golden"]
  assert int(np.sum(np.asarray(result.top1) == golden["top1"])) >= (31 if golden_parity.GOLDEN_STACK else 28)
  np.testing.assert_allclose(np.asarray(result.xent), golden["main_xent_per_token"], rtol=0.05)


@pytest.mark.parametrize("reference, quantization", [("v4_a_noquant_maxtext_op_by_op.npz", []),
                                                     ("v4_fp8full_maxtext_op_by_op.npz", ["quantization=fp8_full"])])
def test_op_by_op_forward_equals_maxtexts_op_by_op_forward(reference, quantization):
  """Without jit (no XLA fusion) every op is MaxText's, Qwix's fp8_full ones included: the logits agree to float
  rounding. (Jitted, both runs move by about 0.05 relative from their op-by-op logits unquantized, 0.24 under
  fp8_full: 43 layers of mHC amplify the fusion's rounding.)"""
  reference = dict(np.load(DATA / "golden" / reference))
  cfg = config.resolve_config(SMALL + quantization)
  model = model_lib.build_model(cfg)
  assert params.assign_arrays(model, _arrays()) == []
  model = running.quantize_for_training(model, cfg)
  logits = np.asarray(model(jnp.asarray(reference["tokens"]), jnp.asarray(reference["positions"]),
                            jnp.asarray(reference["segment_ids"])), np.float64)
  bound = BOUNDS["op_by_op_fp8" if quantization else "op_by_op"]
  assert np.linalg.norm(logits - reference["logits"]) / np.linalg.norm(reference["logits"]) <= bound


def test_jitted_fp8_full_forward_equals_maxtexts_jitted_forward():
  """MaxText's model call under `nnx.jit` with fp8_full: our jitted forward fuses the same way here."""
  reference = dict(np.load(DATA / "golden" / "v4_fp8full_maxtext_jit.npz"))
  cfg = config.resolve_config(SMALL + ["quantization=fp8_full"])
  model = model_lib.build_model(cfg)
  assert params.assign_arrays(model, _arrays()) == []
  result = forward.run_forward(running.quantize_for_training(model, cfg), reference["tokens"],
                               positions=reference["positions"], segment_ids=reference["segment_ids"])
  rel = np.linalg.norm(np.asarray(result.logits, np.float64) - reference["logits"]) / np.linalg.norm(reference["logits"])
  assert rel <= BOUNDS["op_by_op_fp8"]


def test_fp8_full_coverage_and_export_plan_reach_the_compressors():
  cfg = config.resolve_config(SMALL + ["quantization=fp8_full"])
  report = coverage.trace_coverage(cfg)
  ops = {(op.module, op.op): report.op_quantized(op) for op in report.ops}
  csa = "decoder/scanned_blocks/layers_1/self_attention/csa_compressor"
  for proj in ("kv_proj", "gate_proj", "indexer/kv_proj", "indexer/gate_proj", "indexer/q_proj", "indexer/weights_proj"):
    assert ops[(f"{csa}/{proj}", "dot_general0")] is True
  assert ops[(f"{csa}/indexer", "einsum1")] is False and (f"{csa}/indexer", "einsum2") not in ops
  hca = "decoder/scanned_blocks/layers_0/self_attention/hca_compressor"
  assert ops[(f"{hca}/kv_proj", "dot_general0")] and ops[(f"{hca}/kv_norm", "einsum0")] is False
  assert ops[("decoder/layers_0/self_attention/o_a_proj", "einsum0")] is False  # grouped: an einsum, not quantized
  assert ops[("decoder/layers_0/mlp/MoeBlock_0", "gmm0")] is True  # hash-routed experts
  weights = plan.plan_export(cfg).weights
  key = ("params", "params", "decoder", "scanned_blocks", "layers_1", "self_attention", "csa_compressor", "indexer",
         "q_proj", "kernel")
  assert weights[key].shape == (16, 20, 128) and weights[key].scale_shape == (1, 20, 128)
