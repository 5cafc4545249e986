"""The model's forward pass against MaxText's golden outputs, and its op structure as Qwix sees it."""

import logging
import pathlib

from absl import logging as absl_logging
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import golden_parity
import orbax_sources
import qwix

from inspect_tool.configuration import config
from inspect_tool.run import forward
from inspect_tool import model as model_lib
from inspect_tool.paramtree import params
from inspect_tool.model import attention
from inspect_tool.model import mtp
from quant.gmm import op as gmm_lib

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR)
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]


def _rel(ours, golden):
  ours, golden = np.asarray(ours, np.float64), np.asarray(golden, np.float64)
  return float(np.linalg.norm(ours - golden) / np.linalg.norm(golden))


@pytest.fixture(scope="module")
def checkpoint_arrays():
  restored = orbax_sources.restore_numpy(str(DATA / "ckpt_deepseek3-tiny-L4-V1024" / "0" / "items"))
  flat = jax.tree_util.tree_flatten_with_path(restored["params"])[0]
  return {("params",) + tuple(str(k.key) for k in path): np.asarray(v) for path, v in flat}


@pytest.fixture(scope="module")
def golden():
  return dict(np.load(DATA / "golden" / "a_noquant.npz"))


def _loaded(tokens, arrays):
  model = model_lib.build_model(config.resolve_config(tokens))
  assert params.assign_arrays(model, arrays) == []
  return model


def _run(model, g, **kw):
  return forward.run_forward(model, g["tokens"], targets=g["targets"], target_mask=g["target_mask"],
                             positions=g["positions"], segment_ids=g["segment_ids"], **kw)


@pytest.fixture(scope="module")
def golden_result(checkpoint_arrays, golden):
  return _run(_loaded(L4, checkpoint_arrays), golden)


# Measured figures and bounds: tests/README.md ("Parity figures").


def test_main_logits_match_maxtext_golden_bit_for_bit(golden_result, golden):
  assert golden_result.logits.shape == (2, 16, 1024) and golden_result.logits.dtype == jnp.float32
  golden_parity.assert_unquantized_reproduces(golden_result.logits, golden["logits"], "main")  # measured: 0 (CPU)
  golden_parity.assert_top1(golden_result.top1, golden["top1"], "unquantized", "main")


def test_mtp_logits_match_maxtext_golden_bit_for_bit(golden_result, golden):
  assert golden_result.mtp_logits.shape == (1, 2, 16, 1024)
  golden_parity.assert_unquantized_reproduces(golden_result.mtp_logits[0], golden["mtp_logits"], "mtp")
  golden_parity.assert_top1(golden_result.mtp_top1[0], golden["mtp_top1"], "unquantized", "mtp")


def test_losses_match_maxtext_golden(golden_result, golden):
  """Per-token cross-entropy: measured 6.2e-8 relative (float32 log-softmax order); MTP sums: exact. On a TPU chip,
  whose logits stand 1.3e-2 from the golden, each loss as far from MaxText's as its logits allow: a token's
  cross-entropy (log-sum-exp minus the target's logit) moves by at most twice the largest change in its row of
  logits, so the main losses, the MTP block's masked sum and the mean stay within those sums (float32 slack 1e-5)."""
  if golden_parity.ON_TPU:
    main = 2 * np.abs(np.asarray(golden_result.logits, np.float64) - golden["logits"]).max(-1)
    mtp = 2 * np.abs(np.asarray(golden_result.mtp_logits[0], np.float64) - golden["mtp_logits"]).max(-1)
    mask = golden["mtp_acceptance__mtp_block__mtp_mask"][0]
    assert np.all(np.abs(np.asarray(golden_result.xent, np.float64) - golden["main_xent_per_token"]) <= main + 1e-5)
    assert abs(float(golden_result.mtp_losses[0]) - float(golden["mtp_losses__mtp_block__losses"][0])) <= float(
        np.sum(mask * mtp)) + 1e-4
    assert abs(float(golden_result.loss) - float(golden["main_xent_per_token"].mean())) <= float(main.mean()) + 1e-5
    return
  np.testing.assert_allclose(np.asarray(golden_result.xent), golden["main_xent_per_token"], rtol=1e-7, atol=0)
  np.testing.assert_array_equal(np.asarray(golden_result.mtp_losses), golden["mtp_losses__mtp_block__losses"])
  np.testing.assert_array_equal(np.asarray(golden_result.mtp_weights), golden["mtp_losses__mtp_block__weights"])
  expected_mtp = 0.1 * golden["mtp_losses__mtp_block__losses"][0] / golden["mtp_losses__mtp_block__weights"][0]
  np.testing.assert_allclose(float(golden_result.mtp_loss), expected_mtp, rtol=1e-7, atol=0)  # measured 0
  expected_loss = golden["main_xent_per_token"].mean()
  np.testing.assert_allclose(float(golden_result.loss), expected_loss, rtol=1.5e-7, atol=0)  # measured 6.5e-8
  np.testing.assert_allclose(float(golden_result.total_loss), expected_loss + expected_mtp, rtol=2e-7,
                             atol=0)  # measured 1.2e-7


def _unscan(arrays, axis=1):
  """Scanned checkpoint arrays → per-layer arrays (Params: layer axis `axis`; other state: axis 0)."""
  out = {}
  for key, value in arrays.items():
    if len(key) > 3 and key[2] == "decoder" and key[3] in ("dense_layers", "moe_layers"):
      layer_axis = 0 if key[-1] == "bias" else axis
      for i in range(value.shape[layer_axis]):
        out[key[:3] + (f"{key[3]}_{i}",) + key[4:]] = np.take(value, i, axis=layer_axis)
    else:
      out[key] = value
  return out


def test_unscanned_and_layer_axis_zero_models_match_maxtext_golden(checkpoint_arrays, golden):
  """The same weights laid out per layer, or with the layer axis first, against MaxText's (scanned) golden.

  param_scan_axis=0 is bit-exact. The unrolled stack is fused differently from a scan body, so its bf16 rounding
  differs: measured relative error 0.01002 (main) and 0.01234 (MTP), top-1 32/32 both; MaxText's own bf16 vs
  float32 compute differ by 0.012 (reference README)."""
  unscanned = _run(_loaded(L4 + ["scan_layers=false"], _unscan(checkpoint_arrays)), golden)
  bounds = (0.0105, 0.0130) if not golden_parity.ON_TPU else tuple(
      golden_parity.TPU_BOUND[("unquantized", head)] for head in ("main", "mtp"))
  assert _rel(unscanned.logits, golden["logits"]) <= bounds[0]
  assert _rel(unscanned.mtp_logits[0], golden["mtp_logits"]) <= bounds[1]
  golden_parity.assert_top1(unscanned.top1, golden["top1"], "unquantized", "main")
  golden_parity.assert_top1(unscanned.mtp_top1[0], golden["mtp_top1"], "unquantized", "mtp")
  axis0 = {k: (np.moveaxis(v, 1, 0) if len(k) > 3 and k[3] in ("dense_layers", "moe_layers") and k[-1] != "bias"
               else v) for k, v in checkpoint_arrays.items()}
  first = _run(_loaded(L4 + ["param_scan_axis=0"], axis0), golden)
  golden_parity.assert_unquantized_reproduces(first.logits, golden["logits"], "main")
  golden_parity.assert_unquantized_reproduces(first.mtp_logits[0], golden["mtp_logits"], "mtp")


def test_forward_without_targets_gives_logits_and_mtp_logits_only(checkpoint_arrays, golden):
  result = forward.run_forward(_loaded(L4, checkpoint_arrays), golden["tokens"])
  golden_parity.assert_unquantized_reproduces(result.logits, golden["logits"], "main")  # measured: bit-exact (CPU)
  golden_parity.assert_unquantized_reproduces(result.mtp_logits[0], golden["mtp_logits"], "mtp")
  assert result.loss is None and result.mtp_losses is None and result.mtp_logits.shape == (1, 2, 16, 1024)


def test_attention_stays_inside_segments_and_is_causal():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 4)), jnp.float32) for _ in range(3))
  # float32 at HIGHEST: the masks are what is compared, not the rounding of two differently shaped programs
  op = attention.AttentionOp(config.resolve_config(["model_name=deepseek3-tiny", "dtype=float32",
                                                    "matmul_precision=highest"]))
  packed = op(q, k, v, jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]]))
  np.testing.assert_allclose(np.asarray(packed[:, 4:]), np.asarray(op(q[:, 4:], k[:, 4:], v[:, 4:])), atol=1e-6)
  np.testing.assert_allclose(np.asarray(packed[:, :4]), np.asarray(op(q[:, :4], k[:, :4], v[:, :4])), atol=1e-6)
  np.testing.assert_allclose(np.asarray(packed[:, 0]), np.asarray(v[:, 0]), atol=1e-6)  # first token sees itself


def test_deepseek2_style_model_runs_with_query_projection_and_softmax_routing():
  cfg = config.resolve_config(["model_name=deepseek2-16b", "override_model_config=true", "base_emb_dim=32",
                               "base_num_query_heads=2", "base_num_kv_heads=2", "base_mlp_dim=48",
                               "base_moe_mlp_dim=16", "base_num_decoder_layers=2", "num_experts=4",
                               "num_experts_per_tok=2", "kv_lora_rank=8", "qk_nope_head_dim=16",
                               "qk_rope_head_dim=8", "v_head_dim=16", "vocab_size=64", "mtp_num_layers=1"])
  model = model_lib.build_model(cfg)
  rng = np.random.default_rng(0)
  params.assign_arrays(model, {leaf.key: rng.standard_normal(leaf.shape).astype(np.float32) * 0.2
                               for leaf in params.param_leaves(model, include_non_params=True)})
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6)
  result = forward.run_forward(model, tokens, targets=np.roll(tokens, -1, axis=1))
  assert result.logits.shape == (2, 6, 64) and np.all(np.isfinite(np.asarray(result.logits)))
  assert np.isfinite(float(result.total_loss)) and result.mtp_weights.tolist() == [10.0]


def test_mtp_shift_zeroes_the_last_position_and_segment_boundaries():
  x = jnp.asarray([[1, 2, 3, 4, 5, 6]])
  assert mtp.shift_left(x).tolist() == [[2, 3, 4, 5, 6, 0]]
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0]])
  assert mtp.shift_left_in_segment(x, segments).tolist() == [[2, 3, 0, 5, 0, 0]]


def _trace(cfg, rules, monkeypatch):
  """Qwix's `[QWIX]` lines and gmm rule lookups for one abstract `quantize_model` call."""
  lines, lookups = set(), set()

  class Handler(logging.Handler):
    def emit(self, record):
      if record.getMessage().startswith("[QWIX]"):
        lines.add(record.getMessage())

  class Provider(qwix.QtProvider):
    def _get_current_rule_and_op_id(self, op_name, *, only_rule=False, repeated_call=False):
      found = super()._get_current_rule_and_op_id(op_name, only_rule=only_rule, repeated_call=repeated_call)
      if only_rule:
        from qwix._src.utils import flax_util  # pylint: disable=import-outside-toplevel
        path = "/".join(map(str, flax_util.get_current_module_path()))
        index = None if found[0] is None else self._rules.index(found[0])
        lookups.add(f"[QWIX-only_rule] module={path!r} op={op_name} rule={index}")
      return found

  # The FP8 grouped matmul is another module's job; this test is about which ops Qwix sees.
  plain = gmm_lib.gmm_fp8.quantized_gmm
  monkeypatch.setattr(gmm_lib.gmm_fp8, "quantized_gmm", lambda lhs, rhs, sizes, rule, pet, **kw: plain(
      lhs, rhs, sizes, None, pet, **kw))
  handler = Handler()
  absl_logging.set_verbosity(absl_logging.DEBUG)
  logging.getLogger("absl").addHandler(handler)
  try:
    ones = jnp.ones((2, 16), jnp.int32)
    provider = Provider(rules)
    nnx.eval_shape(lambda m: qwix.quantize_model(m, provider, ones, ones, ones, enable_dropout=False,
                                                 decoder_target_tokens=ones, decoder_target_mask=ones),
                   model_lib.build_model(cfg))
  finally:
    logging.getLogger("absl").removeHandler(handler)
    absl_logging.set_verbosity(absl_logging.WARNING)
  return lines, lookups, provider


def _fp8_full_rule(module_path):
  return qwix.QtRule(module_path=module_path, op_names=("dot_general", "gmm", "ragged_dot"),
                     weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2,
                     weight_calibration_method="absmax", act_calibration_method="absmax",
                     bwd_calibration_method="absmax", additional_qt_config={"sparsity_rule": None})


def _reference_lines(name):
  return {line.strip() for line in (DATA / "qwix" / name).read_text().splitlines() if line.strip()}


def test_qwix_sees_exactly_maxtexts_ops_modules_and_rules(monkeypatch):
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1"])
  lines, lookups, provider = _trace(cfg, [_fp8_full_rule("(decoder/.*layers.*|mtp_block/.*)")], monkeypatch)
  assert lines == _reference_lines("deepseek3-tiny_quantize_mtp_true.txt")
  assert lookups == _reference_lines("deepseek3-tiny_quantize_mtp_true_gmm_lookups.txt")
  assert not provider.get_unused_rules()


def test_without_megablox_experts_are_qwix_ragged_dots(monkeypatch):
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1", "megablox=false"])
  lines, lookups, _ = _trace(cfg, [_fp8_full_rule("decoder/.*layers.*")], monkeypatch)
  block = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0"
  assert {f"[QWIX] module='{block}' op=ragged_dot{i} rule=0" for i in range(3)} <= lines
  assert not [line for line in lines if "gmm" in line] and not lookups


def test_qwix_ptq_quantizes_scanned_stacks_with_the_layer_axis_kept_at_param_scan_axis():
  cfg = config.resolve_config(L4)
  rule = qwix.QtRule(module_path="(decoder/.*layers.*|mtp_block/.*)", op_names=("dot_general",),
                     weight_qtype=jnp.float8_e4m3fn)
  ones = jnp.ones((2, 16), jnp.int32)
  quantized = nnx.eval_shape(lambda m: qwix.quantize_model(m, qwix.PtqProvider([rule]), ones, ones, ones,
                                                           decoder_target_tokens=ones, decoder_target_mask=ones),
                             model_lib.build_model(cfg))
  leaves = {leaf.dotted: (leaf.shape, leaf.dtype) for leaf in params.param_leaves(quantized)}
  base = "params.params.decoder.moe_layers."
  assert leaves[base + "self_attention.wq_b.kernel.array.qvalue"] == ((32, 3, 4, 192), "float8_e4m3fn")
  assert leaves[base + "self_attention.wq_b.kernel.array.scale"] == ((1, 3, 4, 192), "bfloat16")
  assert leaves[base + "self_attention.out.kernel.array.scale"] == ((1, 3, 1, 64), "bfloat16")
  assert leaves[base + "DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel.array.scale"] == ((1, 3, 16), "bfloat16")
  assert leaves["params.params.mtp_block.mtp_layer_1.mtp_1_projection.kernel.array.scale"] == ((1, 64), "bfloat16")
  assert leaves[base + "DeepSeekMoeBlock_0.MoeBlock_0.wi_0"] == ((16, 3, 64, 64), "float32")
  assert leaves["params.params.decoder.logits_dense.kernel"] == ((64, 1024), "float32")
