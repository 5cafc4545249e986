"""Coverage tracing: every op Qwix intercepts (and every gmm rule lookup) with its rule, weight and FLOPs.

Part 1 uses a toy NNX model (tests/qwix_toy_model.py) and Qwix's own provider as the oracle; part 2 checks
the DeepSeek model (`inspect_tool.coverage.trace`) against MaxText's Qwix traces in tests/data/qwix/.
"""

import functools
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest
import qwix
from flax import nnx

import qwix_toy_model as toy
from quant import coverage, rules

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR) / "qwix"
TOKENS = jax.ShapeDtypeStruct((1, 4), jnp.int32)
MAIN = qwix.QtRule(module_path="(decoder/layers.*|mtp/.*)", weight_qtype=jnp.float8_e4m3fn,
                   act_qtype=jnp.float8_e4m3fn, op_names=("dot_general", "gmm", "ragged_dot"))


def _trace(use_gmm=True, rule_list=(MAIN,), tokens=TOKENS):
  return coverage.trace_model(toy.abstract_toy(use_gmm=use_gmm), list(rule_list), tokens, targets=tokens,
                              experts_per_token=toy.TOP_K)


def _qwix_oracle(use_gmm, rule_list):
  """What Qwix itself does: its (module, op id) log keys and its rule match counters."""
  provider = qwix.QtProvider(list(rule_list))
  nnx.eval_shape(lambda m, t: qwix.quantize_model(m, provider, t, targets=t) and None,
                 toy.abstract_toy(use_gmm=use_gmm), TOKENS)
  return provider._logged_ops, tuple(provider._rule_matches)  # pylint: disable=protected-access


@pytest.mark.parametrize("use_gmm", [True, False])
def test_toy_ops_and_match_counts_equal_qwix_own(use_gmm):
  rule_list = [rules.router_unquantized_rule(), MAIN]
  trace = _trace(use_gmm, rule_list)
  logged, matches = _qwix_oracle(use_gmm, rule_list)
  assert {(op.module, op.op) for op in trace.ops if not op.lookup} == logged
  assert trace.rule_matches == matches


def test_gmm_lookups_get_per_module_ids_rules_and_expert_weights():
  lookups = [op for op in _trace().ops if op.lookup]
  assert [(op.module, op.op, op.op_name, op.rule) for op in lookups] == [
      ("decoder/layers/MoeBlock_0", f"gmm{i}", "gmm", 0) for i in range(3)] + [
      ("mtp/layer/MoeBlock_0", f"gmm{i}", "gmm", 0) for i in range(3)]
  assert [op.weight.rsplit("/", 1)[1] for op in lookups] == ["wi_0", "wi_1", "wo"] * 2


def test_ragged_dot_ops_take_the_expert_weights():
  ragged = [op for op in _trace(use_gmm=False).ops if op.op_name == "ragged_dot"]
  assert [(op.module, op.op) for op in ragged][:3] == [("decoder/layers/MoeBlock_0", f"ragged_dot{i}") for i in range(3)]
  assert [op.weight for op in ragged][:3] == [f"decoder/layers/MoeBlock_0/{n}" for n in ("wi_0", "wi_1", "wo")]


def test_scanned_weights_count_every_layer_and_flops_follow_the_weight():
  ops = {(op.module, op.op): op for op in _trace().ops}
  proj = ops["decoder/layers/proj", "dot_general0"]
  assert proj.weight_shape == (toy.DIM, toy.LAYERS, toy.DIM)  # layer axis at 1: the whole stack
  assert proj.params == toy.DIM * toy.LAYERS * toy.DIM and proj.flops_per_token == 2 * proj.params
  expert = ops["decoder/layers/MoeBlock_0", "gmm0"]
  assert expert.params == toy.EXPERTS * toy.LAYERS * toy.DIM * toy.FFN
  assert expert.flops_per_token == 2 * expert.params * toy.TOP_K // toy.EXPERTS
  head0, head1 = ops["decoder/head", "dot_general0"], ops["decoder/head", "dot_general1"]
  assert head0.weight == head1.weight == "decoder/head/kernel" and head1.rule is None


def test_norm_einsums_consume_weights_but_are_not_matmuls():
  norm = next(op for op in _trace().ops if op.module == "decoder/layers/norm")
  assert (norm.op, norm.op_name, norm.weight, norm.matmul, norm.flops_per_token) == (
      "einsum0", "einsum", "decoder/layers/norm/scale", False, 0)
  combine = next(op for op in _trace().ops if op.module == "decoder/layers/MoeBlock_0" and op.op_name == "einsum")
  assert combine.weight is None and not combine.matmul


def test_flops_per_token_do_not_depend_on_the_sequence_length():
  short = _trace(tokens=jax.ShapeDtypeStruct((1, 2), jnp.int32))
  long = _trace(tokens=jax.ShapeDtypeStruct((2, 16), jnp.int32))
  assert [(o.op, o.flops_per_token, o.params) for o in short.ops] == [(o.op, o.flops_per_token, o.params)
                                                                       for o in long.ops]


def test_trace_leaves_the_model_untouched_and_abstract():
  model = toy.abstract_toy()
  coverage.trace_model(model, [MAIN], TOKENS, targets=TOKENS)
  assert not hasattr(model.decoder, "qwix_path")
  assert isinstance(model.decoder.head.kernel.get_value(), jax.ShapeDtypeStruct)


def test_param_shapes_list_every_param():
  shapes = coverage.param_shapes(toy.abstract_toy(mtp=False))
  assert shapes["embed"] == (toy.VOCAB, toy.DIM)
  assert shapes["decoder/layers/MoeBlock_0/wo"] == (toy.EXPERTS, toy.LAYERS, toy.FFN, toy.DIM)


class _Lowered(nnx.Module):
  """Calls dot_general from a function that looks like JAX's own ragged_dot implementation."""

  def __init__(self):
    self.kernel = nnx.Param(jnp.ones((4, 4)))
    namespace = {"jax": jax}
    exec(compile("def _ragged_dot_general_impl(x, w):\n"  # pylint: disable=exec-used
                 "  return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())))\n",
                 "/site-packages/jax/_src/lax/fake_lowering.py", "exec"), namespace)
    self.impl = namespace["_ragged_dot_general_impl"]

  def __call__(self, x):
    return jax.lax.dot_general(x, self.kernel[...], (((1,), (0,)), ((), ()))) + self.impl(x, self.kernel[...])


def test_dot_generals_from_jax_ragged_dot_lowering_are_flagged_and_hidden():
  model = nnx.eval_shape(_Lowered)
  trace = coverage.trace_model(model, [MAIN], jax.ShapeDtypeStruct((2, 4), jnp.float32))
  assert [(op.op, op.lowering) for op in trace.ops] == [("dot_general0", False), ("dot_general1", True)]
  assert [op.op for op in trace.visible_ops()] == ["dot_general0"]


# DeepSeek model against MaxText's own Qwix traces ---------------------------------------------------------

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "quantization=fp8_full"]
SMALL = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
         "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


@functools.lru_cache(maxsize=None)
def _deepseek(*keys):
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace as ds_coverage  # pylint: disable=import-outside-toplevel

  return ds_coverage.trace(config.resolve_config(list(keys)))


def _lines(trace):
  return [f"[QWIX] module={op.module!r} op={op.op} rule={op.rule}" for op in trace.visible_ops() if not op.lookup]


@pytest.mark.parametrize("quantize_mtp", ["false", "true"])
def test_deepseek_trace_equals_maxtext(quantize_mtp):
  trace = _deepseek(*TINY, f"quantize_mtp={quantize_mtp}")
  assert _lines(trace) == (DATA / f"deepseek3-tiny_quantize_mtp_{quantize_mtp}.txt").read_text().splitlines()
  lookups = dict.fromkeys(f"[QWIX-only_rule] module={op.module!r} op={op.op_name} rule={op.rule}"
                          for op in trace.ops if op.lookup)
  expected = (DATA / f"deepseek3-tiny_quantize_mtp_{quantize_mtp}_gmm_lookups.txt").read_text().splitlines()
  assert list(lookups) == expected
  assert trace.rule_matches == ((33,) if quantize_mtp == "true" else (20,))  # 17 or 30 dot_generals + 3 gmm


@pytest.mark.parametrize("quantize_mtp,rule", [("true", 0), ("false", None)])
def test_mtp_attention_output_and_experts_follow_quantize_mtp(quantize_mtp, rule):
  ops = {(op.module, op.op): op for op in _deepseek(*TINY, f"quantize_mtp={quantize_mtp}").ops}
  layer = "mtp_block/mtp_layer_1/mtp_1_transformer_layer"
  assert ops[f"{layer}/self_attention/out", "dot_general0"].rule == rule
  assert [ops[f"{layer}/DeepSeekMoeBlock_0/MoeBlock_0", f"gmm{i}"].rule for i in range(3)] == [rule] * 3
  assert ops["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0", "gmm0"].rule == 0


def test_deepseek_megablox_off_router_off_logits_on():
  trace = _deepseek(*TINY, "quantize_mtp=true", "megablox=false", "quantize_router_proj=false",
                    "quantize_logits_proj=true")
  assert trace.rule_matches == (2, 2, 31)
  ops = {(op.module, op.op): op.rule for op in trace.ops}
  for prefix in ("decoder/moe_layers", "mtp_block/mtp_layer_1/mtp_1_transformer_layer"):
    assert ops[f"{prefix}/DeepSeekMoeBlock_0/MoeBlock_0/gate", "dot_general0"] == 0  # the all-None rule
    assert [ops[f"{prefix}/DeepSeekMoeBlock_0/MoeBlock_0", f"ragged_dot{i}"] for i in range(3)] == [2, 2, 2]
  assert ops["decoder/logits_dense", "dot_general0"] == ops["decoder/logits_dense", "dot_general1"] == 1
  assert not any(op.lookup for op in trace.ops)
  # JAX's CPU ragged_dot decomposition never runs under the abstract trace, so MaxText's spurious
  # `module='decoder' op=dot_general0` (from that lowering) does not appear.
  assert ("decoder", "dot_general0") not in ops
  assert not any(op.lowering for op in trace.ops)


def test_deepseek_unscanned_layers_each_get_the_main_rule():
  trace = _deepseek(*SMALL, "scan_layers=false")
  ops = {(op.module, op.op): op for op in trace.ops}
  assert ops["decoder/dense_layers_0/mlp/wi_0", "dot_general0"].rule == 0
  for j in range(3):
    assert [ops[f"decoder/moe_layers_{j}/DeepSeekMoeBlock_0/MoeBlock_0", f"gmm{i}"].rule for i in range(3)] == [0] * 3
    out = ops[f"decoder/moe_layers_{j}/self_attention/out", "dot_general0"]
    assert out.rule == 0 and out.weight_shape == (4, 128, 64)  # per-layer weight, no layer axis
  assert ops["mtp_block/mtp_layer_1/mtp_1_projection", "dot_general0"].rule is None


def test_deepseek_router_off_keeps_gmm_on_main_rule():
  ops = {(op.module, op.op): op.rule for op in _deepseek(*SMALL, "quantize_router_proj=false").ops}
  assert ops["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate", "dot_general0"] == 0
  assert ops["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0", "gmm0"] == 1
  assert ops["mtp_block/mtp_layer_1/mtp_1_transformer_layer/DeepSeekMoeBlock_0/MoeBlock_0/gate", "dot_general0"] == 0


def test_deepseek_int8_rule_skips_routed_experts():
  trace = _deepseek(*SMALL[:-1], "quantization=int8")
  ops = {(op.module, op.op): op.rule for op in trace.ops}
  assert ops["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate", "dot_general0"] == 0
  assert ops["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0", "gmm0"] is None


def test_deepseek_user_rule_file(tmp_path):
  path = tmp_path / "rules.yml"
  path.write_text("- module_path: 'mtp_block/.*'\n  op_names: [gmm]\n  weight_qtype: int8\n")
  trace = _deepseek_with_rules(str(path))
  rules_by_op = {(op.module, op.op): op.rule for op in trace.ops}
  assert rules_by_op["mtp_block/mtp_layer_1/mtp_1_transformer_layer/DeepSeekMoeBlock_0/MoeBlock_0", "gmm2"] == 0
  assert rules_by_op["decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0", "gmm2"] is None
  assert trace.rule_matches == (3,) and trace.provider == "qt"


def _deepseek_with_rules(rule_source):
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace as ds_coverage  # pylint: disable=import-outside-toplevel

  return ds_coverage.trace(config.resolve_config(SMALL), rule_source)


def test_deepseek_671b_trace_counts_every_parameter():
  trace = _deepseek("model_name=deepseek3-671b", "mtp_num_layers=1", "quantization=fp8_full", "quantize_mtp=true")
  assert sum(math.prod(shape) for shape in trace.param_shapes.values()) == 682_636_472_320  # MaxText's total
  experts = next(op for op in trace.ops if op.module == "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0"
                 and op.op == "gmm0")
  assert experts.weight_shape == (256, 58, 7168, 2048)
  assert experts.flops_per_token == 2 * 58 * 7168 * 2048 * 8  # 8 of 256 experts per token, 58 layers
  assert rules.quantizes(trace.rules[experts.rule], "gmm")
