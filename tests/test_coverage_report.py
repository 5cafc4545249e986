"""The coverage report: rule match counts, unused and shadowed rules, unquantized weights, shares, explain."""

import functools

import jax
import jax.numpy as jnp
import pytest
import qwix

import qwix_toy_model as toy
from quant import coverage, rules
from inspect_tool.report import coverage_report

TOKENS = jax.ShapeDtypeStruct((1, 4), jnp.int32)
MAIN = qwix.QtRule(module_path="(decoder/layers.*|mtp/.*)", weight_qtype=jnp.float8_e4m3fn,
                   act_qtype=jnp.float8_e4m3fn, op_names=("dot_general", "gmm", "ragged_dot"))
MTP_INT8 = qwix.QtRule(module_path="mtp/.*", weight_qtype=jnp.int8, op_names=("dot_general",))
NOWHERE = qwix.QtRule(module_path="nothing/.*", weight_qtype=jnp.int8)
TOY_RULES = (rules.router_unquantized_rule(), MAIN, MTP_INT8, NOWHERE)
TOY_GROUPS = (("mtp/", "mtp"), ("decoder/head", "head"))


@functools.lru_cache(maxsize=None)
def _toy_report(rule_list=TOY_RULES):
  trace = coverage.trace_model(toy.abstract_toy(), list(rule_list), TOKENS, targets=TOKENS,
                               experts_per_token=toy.TOP_K)
  return coverage_report.build_report(trace, TOY_GROUPS, "decoder")


def test_rule_rows_carry_qwix_match_counts():
  report = _toy_report()
  assert [row.matches for row in report.rules] == [2, 9, 0, 0]  # 2 gates; 3 projections + 6 expert lookups
  assert [row.ops for row in report.rules] == [2, 9, 0, 0]


def test_unused_and_shadowed_rules():
  report = _toy_report()
  assert report.unused_rules == (2, 3)
  assert [(s.index, s.by) for s in report.shadowed_rules] == [(2, (0, 1))]  # mtp proj won by 1, mtp gate by 0


def test_unquantized_weights_are_the_matmul_weights_no_quantized_op_reaches():
  report = _toy_report()
  assert [(w.weight, w.group, w.rules) for w in report.unquantized_weights] == [
      ("decoder/layers/MoeBlock_0/gate/kernel", "decoder", (0,)),
      ("decoder/head/kernel", "head", (None, None)),  # main head and the MTP block's call of it
      ("mtp/layer/MoeBlock_0/gate/kernel", "mtp", (0,)),
  ]
  head = next(w for w in report.weights if w.weight == "decoder/head/kernel")
  assert head.ops == ("decoder/head:dot_general0", "decoder/head:dot_general1")
  assert head.flops_per_token == 2 * 2 * toy.DIM * toy.VOCAB  # FLOPs count per op, params once


def test_group_summaries_and_total():
  report = _toy_report()
  groups = {s.group: s for s in report.groups}
  assert list(groups) == ["decoder", "mtp", "head"]
  layers, dim, ffn, experts = toy.LAYERS, toy.DIM, toy.FFN, toy.EXPERTS
  decoder = groups["decoder"]
  gate, proj, expert = dim * experts * layers, dim * dim * layers, experts * dim * ffn * layers
  assert (decoder.weights, decoder.quantized_weights) == (5, 4)
  assert (decoder.params, decoder.quantized_params) == (gate + proj + 3 * expert, proj + 3 * expert)
  assert decoder.flops_per_token == 2 * (gate + proj) + 3 * 2 * expert * toy.TOP_K // experts
  assert groups["head"].params_share == 0.0 and groups["head"].flops_share == 0.0
  assert report.total.params == sum(s.params for s in report.groups)
  all_params = sum(int(jnp.prod(jnp.array(s))) for s in coverage.param_shapes(toy.abstract_toy()).values())
  assert report.total.params + report.other_params == all_params


def test_module_rules_gives_each_module_the_rule_that_won_its_weights():
  module_rules = _toy_report().module_rules()
  assert module_rules["decoder/layers/MoeBlock_0"] == 1  # gmm lookups win over the unmatched combine einsum
  assert module_rules["decoder/layers/MoeBlock_0/gate"] == 0
  assert module_rules["decoder/head"] is None and module_rules["decoder/layers/norm"] is None


def test_strict_findings_name_unused_rules_and_unquantized_decoder_weights():
  findings = _toy_report().strict_findings()
  assert findings[0].startswith("rule 2 (module_path 'mtp/.*'") and "shadowed by rule 0, 1" in findings[0]
  assert "rule 3" in findings[1] and "matches no op" in findings[1]
  assert findings[2].startswith("decoder weight decoder/layers/MoeBlock_0/gate/kernel")
  assert len(findings) == 3  # the head and the MTP gate are not in the required group
  assert len(_toy_report().strict_findings(required_groups=("decoder", "mtp", "head"))) == 5


def test_a_clean_rule_set_has_no_strict_findings():
  clean = (qwix.QtRule(module_path=".*", weight_qtype=jnp.int8, op_names=("dot_general", "gmm")),)
  report = _toy_report(clean)
  assert report.strict_findings(required_groups=("decoder", "mtp", "head")) == []
  assert report.total.params_share == 1.0 and report.total.flops_share == 1.0


def test_explain_with_a_report_lists_each_rule_for_each_recorded_op_name():
  explanations = coverage_report.explain(_toy_report(), "mtp/layer/MoeBlock_0")
  assert [e.op_name for e in explanations] == ["gmm", "einsum"]
  gmm = explanations[0]
  assert gmm.winner == 1 and [op.op for op in gmm.ops] == ["gmm0", "gmm1", "gmm2"]
  assert [(v.path_matches, v.op_matches, v.wins) for v in gmm.verdicts] == [
      (False, False, False), (True, True, True), (True, False, False), (False, True, False)]
  assert explanations[1].winner is None


def test_explain_reports_shadowing_by_an_earlier_rule():
  (verdicts,) = [e.verdicts for e in coverage_report.explain(list(TOY_RULES), "mtp/proj", "dot_general")]
  assert [(v.index, v.wins, v.shadowed_by) for v in verdicts] == [(0, False, None), (1, True, None),
                                                                 (2, False, 1), (3, False, None)]


def test_explain_with_plain_rules_covers_the_op_names_the_path_could_use():
  explanations = coverage_report.explain(list(TOY_RULES), "mtp/layer/MoeBlock_0/gate")
  assert {e.op_name: e.winner for e in explanations} == {"dot_general": 0, "gmm": 1, "ragged_dot": 1}


# DeepSeek reports ------------------------------------------------------------------------------------------

TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]


@functools.lru_cache(maxsize=None)
def _deepseek(*keys):
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.coverage import trace as ds_coverage  # pylint: disable=import-outside-toplevel

  return ds_coverage.trace_coverage(config.resolve_config(TINY + list(keys)))


@pytest.mark.parametrize("quantize_mtp,mtp_share", [("true", 1.0), ("false", 0.0)])
def test_deepseek_shares_split_decoder_mtp_head(quantize_mtp, mtp_share):
  report = _deepseek("quantization=fp8_full", f"quantize_mtp={quantize_mtp}")
  groups = {s.group: s for s in report.groups}
  assert list(groups) == ["decoder", "mtp", "head"]
  assert groups["decoder"].params_share == 1.0 and groups["decoder"].flops_share == 1.0
  assert groups["mtp"].params_share == mtp_share and groups["mtp"].flops_share == mtp_share
  assert groups["head"].weights == 1 and groups["head"].params_share == 0.0
  head = next(w for w in report.weights if w.group == "head")
  assert head.ops == ("decoder/logits_dense:dot_general0", "decoder/logits_dense:dot_general1")
  assert report.strict_findings() == []  # every decoder matmul weight quantized, the rule is used


def test_deepseek_strict_flags_the_unquantized_router_and_int8_experts():
  router_off = _deepseek("quantization=fp8_full", "quantize_router_proj=false").strict_findings()
  assert router_off == [
      "decoder weight decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel (moe stack: router, 3,072 params) "
      "is not quantized "
      "(ops decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate:dot_general0)"]
  int8 = _deepseek("quantization=int8").strict_findings()
  assert [f.split()[2].rsplit("/", 1)[1] for f in int8] == ["wi_0", "wi_1", "wo"]


def test_deepseek_module_rules_for_the_html_view():
  module_rules = _deepseek("quantization=fp8_full", "quantize_mtp=true").module_rules()
  assert module_rules["mtp_block/mtp_layer_1/mtp_1_transformer_layer/DeepSeekMoeBlock_0/MoeBlock_0"] == 0
  assert module_rules["decoder/logits_dense"] is None
  assert module_rules["decoder/decoder_norm"] is None


def test_deepseek_without_quantization_has_no_rules_and_nothing_quantized():
  report = _deepseek()
  assert report.rules == () and report.total.quantized_params == 0 and report.provider == "qt"
  assert report.total.params + report.other_params == 1_396_848  # MaxText's total for this model


def test_explain_an_untraced_module_suggests_close_paths():
  (explanation, *_) = coverage_report.explain(_toy_report(), "mtp/layer/MoeBlock_1")
  assert explanation.traced is False and explanation.suggestions[0] == "mtp/layer/MoeBlock_0"
  (plain, *_) = coverage_report.explain(list(TOY_RULES), "mtp/proj", "dot_general")
  assert plain.traced is None and plain.suggestions == ()
