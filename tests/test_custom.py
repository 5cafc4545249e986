"""deepseek-custom (DeepSeek-V3.2 indexer + manifold-constrained hyper-connections, Engram off): the tree against
MaxText 0.2.5's listings, MaxText's refusals, and the mHC mixing against a NumPy evaluation of its formula."""

import pathlib

import jax.numpy as jnp
import numpy as np
import pytest
import qwix
from flax import nnx

import maxtext_listings

from inspect_tool import cli
from inspect_tool.configuration import config
from inspect_tool.coverage import trace as coverage
from inspect_tool import errors
from inspect_tool import model as model_lib
from inspect_tool.paramtree import params
from inspect_tool.model import initializers as inits
from inspect_tool.model import mhc
from quant import compat
from quant import errors as quant_errors

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR) / "listings"
RUNS = pathlib.Path(DATA_DIR) / "maxtext_runs"
CUSTOM = ["model_name=deepseek-custom", "override_model_config=true", "engram_layers=[]"]
SMALL = CUSTOM + ["base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=64",
                  "base_moe_mlp_dim=16", "base_num_decoder_layers=2", "vocab_size=64", "num_experts=4",
                  "q_lora_rank=16", "kv_lora_rank=8", "qk_nope_head_dim=8", "qk_rope_head_dim=8", "v_head_dim=8",
                  "indexer_n_heads=2", "indexer_head_dim=16", "indexer_topk=4", "max_target_length=16"]



@pytest.mark.parametrize("listing, extra, total", [
    ("deepseek-custom_scan_mtp0.txt", [], 428491924),
    ("deepseek-custom_noscan_mtp0.txt", ["scan_layers=false"], 428491924),
    ("deepseek-custom_scan_mtp1.txt", ["mtp_num_layers=1"], 461290330),
    ("deepseek-custom_noscan_mtp1.txt", ["scan_layers=false", "mtp_num_layers=1"], 461290330)])
def test_param_tree_equals_maxtext_listing(listing, extra, total):
  """MTP included: MaxText builds and lists the MTP layer with its mHC although its forward pass fails there."""
  assert set(maxtext_listings.model_keys(listing)) - {"scan_layers=true"} == set(CUSTOM + extra)
  leaves = params.param_leaves(model_lib.build_model(config.resolve_config(CUSTOM + extra)))
  assert {(leaf.dotted, leaf.shape, leaf.dtype) for leaf in leaves} == maxtext_listings.entries(listing)
  assert sum(leaf.size for leaf in leaves) == total  # MaxText 0.2.5's printed total


def test_engram_is_refused_in_one_line():
  with pytest.raises(errors.ConfigError, match=r"engram_layers=\['1', '4'\] is not supported.*engram_layers=\[\]"):
    config.resolve_config(["model_name=deepseek-custom"])


def _maxtext_forward_error(name):
  """The exception line of MaxText's own forward pass (tests/data/maxtext_runs/, see its README)."""
  lines = (RUNS / name).read_text().splitlines()
  return lines[-1]


@pytest.mark.parametrize("command", [["forward"], ["export", "quantization=fp8_full", "--no-validate", "--random-init"]])
def test_mtp_with_mhc_runs_are_refused_in_one_line_with_maxtexts_reason(command, capsys, tmp_path):
  """MaxText's forward fails in the MTP layer's mHC (deepseek-custom_mtp1.txt); it runs without MTP (_mtp0.txt)."""
  assert _maxtext_forward_error("deepseek-custom_mtp0.txt") == "OK"
  reason = _maxtext_forward_error("deepseek-custom_mtp1.txt")
  assert reason.startswith("ValueError: not enough values to unpack")
  extra = ["--output", str(tmp_path / "out")] if command[0] == "export" else []
  code = cli.main([command[0], *CUSTOM, "mtp_num_layers=1", *command[1:], *extra])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err[-2000:]
  assert f"{command[0]}: mtp_num_layers=1 with mhc_expansion_rate=4" in err
  assert reason[len("ValueError: "):] in err and "accepted: mtp_num_layers=0" in err
  assert not (tmp_path / "out").exists()


def test_rules_on_mtp_with_mhc_traces_what_runs_before_the_mtp_layer(capsys):
  """MaxText's forward reaches the MTP layer (after the decoder and head) and fails there: no mtp_block op."""
  frames = (RUNS / "deepseek-custom_mtp1.txt").read_text()
  assert "multi_token_prediction.py" in frames and "models/models.py:339 __call__: self.mtp_block(" in frames
  code = cli.main(["rules", *CUSTOM, "mtp_num_layers=1", "quantization=fp8_full", "--format", "json"])
  captured = capsys.readouterr()
  assert code == 0
  assert captured.err.startswith("note: mtp_block is not traced: mtp_num_layers=1 with mhc_expansion_rate=4")
  assert len(captured.err.strip().splitlines()) == 1
  traced = coverage.trace(config.resolve_config(CUSTOM + ["mtp_num_layers=1", "quantization=fp8_full"]))
  modules = {op.module for op in traced.ops}
  assert not any(m.startswith("mtp_block/") for m in modules)
  assert "decoder/logits_dense" in modules and "decoder/moe_layers/mhc_mlp" in modules
  assert any(w.startswith("mtp_block/") for w in traced.param_shapes)  # the block is built, only not run


def _numpy_mhc(x, p, branch, eps, iters):
  """The mHC formula (see `inspect_tool.model.mhc`) in float64 NumPy; `branch` maps [b, s, E] → [b, s, E]."""
  b, s, k, d = x.shape
  flat = x.reshape(b, s, k * d)
  normed = flat / np.sqrt(np.mean(flat ** 2, axis=-1, keepdims=True) + eps) * p["mhc_norm"]
  h = normed @ np.concatenate([p["pre_alpha"], p["post_alpha"], p["res_alpha"]], axis=-1)
  sig = lambda z: 1 / (1 + np.exp(-z))
  pre = sig(p["pre_alpha_scale"] * h[..., :k] + p["pre_beta"]) + 1e-6
  post = 2 * sig(p["post_alpha_scale"] * h[..., k:2 * k] + p["post_beta"])
  t = p["res_alpha_scale"] * h[..., 2 * k:].reshape(b, s, k, k) + p["res_beta"]
  t = np.exp(t - t.max(-1, keepdims=True))
  t = t / t.sum(-1, keepdims=True) + 1e-6
  t = t / (t.sum(-2, keepdims=True) + 1e-6)
  for _ in range(iters - 1):
    t = t / (t.sum(-1, keepdims=True) + 1e-6)
    t = t / (t.sum(-2, keepdims=True) + 1e-6)
  mixed = np.einsum("bsk,bskd->bsd", pre, x)
  return np.einsum("bskm,bskd->bsmd", t, x) + branch(mixed)[:, :, None, :] * post[..., None]


def test_mhc_mixing_matches_numpy_formula():
  cfg = config.resolve_config(SMALL + ["dtype=float32"])
  module = mhc.ManifoldConstrainedHyperConnections(cfg, inits.VariableFactory(weight_dtype="float32", seed=3))
  rng = np.random.default_rng(0)
  p = {name: rng.normal(size=getattr(module, name)[...].shape).astype(np.float32)
       for name in ("pre_alpha", "post_alpha", "res_alpha", "pre_beta", "post_beta", "res_beta",
                    "pre_alpha_scale", "post_alpha_scale", "res_alpha_scale")}
  p["mhc_norm"] = rng.normal(size=(4 * 32,)).astype(np.float32)
  for name, value in p.items():
    target = module.mhc_norm.scale if name == "mhc_norm" else getattr(module, name)
    target.set_value(jnp.asarray(value))
  x = rng.normal(size=(2, 3, 4, 32)).astype(np.float32)
  weight = rng.normal(size=(32, 32)).astype(np.float32) / 6
  ours = module(lambda h: h * 0.5, lambda h: h @ weight, jnp.asarray(x))
  expected = _numpy_mhc(x.astype(np.float64), {k: v.astype(np.float64) for k, v in p.items()},
                        lambda h: (h * 0.5) @ weight, cfg.normalization_layer_epsilon, 20)
  np.testing.assert_allclose(np.asarray(ours), expected, rtol=2e-4, atol=2e-4)


def test_sinkhorn_output_is_doubly_stochastic():
  t = mhc.sinkhorn(jnp.asarray(np.random.default_rng(1).normal(size=(5, 4, 4)) * 3, jnp.float32), 20)
  np.testing.assert_allclose(np.asarray(t).sum(-1), 1, atol=1e-3)
  np.testing.assert_allclose(np.asarray(t).sum(-2), 1, atol=1e-3)


def test_forward_runs_and_coverage_names_the_mhc_ops():
  cfg = config.resolve_config(SMALL)
  model = model_lib.build_model(cfg, abstract=False, seed=0)
  tokens = jnp.asarray(np.arange(16).reshape(1, 16) % 64, jnp.int32)
  logits = model(tokens, jnp.arange(16)[None], jnp.ones((1, 16), jnp.int32))
  assert logits.shape == (1, 16, 64) and bool(jnp.all(jnp.isfinite(logits)))
  report = coverage.trace_coverage(config.resolve_config(SMALL + ["quantization=fp8_full"]))
  ops = {(op.module, op.op) for op in report.ops}
  for branch in ("mhc_attention", "mhc_mlp"):
    assert {(f"decoder/moe_layers/{branch}", f"einsum{i}") for i in range(3)} <= ops
    assert (f"decoder/moe_layers/{branch}", "einsum3") not in ops
    assert (f"decoder/moe_layers/{branch}/mhc_norm", "einsum0") in ops
  # MaxText also normalises the attention residual once outside mhc_mlp (and drops it): two norm einsums.
  assert ("decoder/moe_layers/post_self_attention_layer_norm", "einsum1") in ops


def test_sizes_that_fooled_qwix_weight_detection_run_under_fp8(capsys):
  """At SMALL's sizes Qwix's QT provider compared `kv_norm`'s pre-transpose shape with `wkv_b`'s kernel and took the
  activation for a weight (MaxText 0.2.5 stops there); our dense layers end its search at their operand."""
  code = cli.main(["forward", *SMALL, "quantization=fp8_full"])
  out, err = capsys.readouterr()
  assert code == 0, err[-2000:]
  assert "took an activation" not in err and "loss" in out.lower()


def test_qwix_taking_both_operands_for_weights_is_one_line():
  """Qwix's own assertion (a matmul of two Params under a QtProvider), raised in a real forward, becomes one line."""
  class TwoParams(nnx.Module):
    def __init__(self):
      self.a = nnx.Param(jnp.ones((8, 8)))
      self.b = nnx.Param(jnp.ones((8, 8)))

    def __call__(self, x):
      return jnp.einsum("ij,jk->ik", self.a[...], self.b[...]) + x

  rule = qwix.QtRule(module_path=".*", weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn)
  model = qwix.quantize_model(TwoParams(), qwix.QtProvider([rule]), jnp.ones((8, 8)), skip_nnx_init=True)
  with pytest.raises(quant_errors.QuantError) as raised, compat.qwix_weight_detection_errors():
    model(jnp.ones((8, 8)))
  message = str(raised.value)
  assert "\n" not in message
  assert "took an activation of this model for a weight ('lhs and rhs cannot be both weights'" in message