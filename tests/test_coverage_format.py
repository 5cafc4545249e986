"""Coverage report renderings: the JSON schema, the text and Markdown reports, explain text."""

import functools
import json

import jax
import jax.numpy as jnp
import qwix

import qwix_toy_model as toy
from quant import coverage, rules
from inspect_tool.report import coverage_format, coverage_report

TOKENS = jax.ShapeDtypeStruct((1, 4), jnp.int32)
RULES = [rules.router_unquantized_rule(),
         qwix.QtRule(module_path="(decoder/layers.*|mtp/.*)", weight_qtype=jnp.float8_e4m3fn,
                     act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2,
                     op_names=("dot_general", "gmm", "ragged_dot")),
         qwix.QtRule(module_path="mtp/.*", weight_qtype=jnp.int8, op_names=("dot_general",))]


@functools.lru_cache(maxsize=None)
def _report():
  trace = coverage.trace_model(toy.abstract_toy(), RULES, TOKENS, targets=TOKENS, experts_per_token=toy.TOP_K)
  return coverage_report.build_report(trace, (("mtp/", "mtp"), ("decoder/head", "head")), "decoder")


def test_json_has_exactly_the_schema_keys():
  data = json.loads(coverage_format.to_json(_report()))
  assert list(data) == ["schema_version", "rules", "ops", "unused_rules", "shadowed_rules", "unquantized_weights",
                        "summary"]
  assert data["schema_version"] == 1
  assert all(list(r) == ["index", "module_path", "op_names", "weight_qtype", "act_qtype", "bwd_qtype", "matches"]
             for r in data["rules"])
  assert all(list(o) == ["module", "op", "op_name", "rule", "weight", "params", "flops_per_token"]
             for o in data["ops"])


def test_json_values_use_qtype_names_and_null_rules():
  data = coverage_format.to_json_data(_report())
  assert data["rules"][0] == {"index": 0, "module_path": ".*/gate$", "op_names": ["dot_general"],
                              "weight_qtype": None, "act_qtype": None, "bwd_qtype": None, "matches": 2}
  assert (data["rules"][1]["weight_qtype"], data["rules"][1]["bwd_qtype"]) == ("float8_e4m3fn", "float8_e5m2")
  head = [o for o in data["ops"] if o["module"] == "decoder/head"]
  assert [(o["op"], o["rule"], o["weight"]) for o in head] == [("dot_general0", None, "decoder/head/kernel"),
                                                                ("dot_general1", None, "decoder/head/kernel")]
  gmm = next(o for o in data["ops"] if o["op"] == "gmm2")
  assert (gmm["module"], gmm["op_name"], gmm["rule"], gmm["weight"]) == (
      "decoder/layers/MoeBlock_0", "gmm", 1, "decoder/layers/MoeBlock_0/wo")
  assert data["unused_rules"] == [2] and data["shadowed_rules"] == [{"index": 2, "shadowed_by": [0, 1]}]
  assert [w["weight"] for w in data["unquantized_weights"]][1] == "decoder/head/kernel"
  summary = data["summary"]
  assert list(summary["groups"]) == ["decoder", "mtp", "head"] and summary["groups"]["head"]["params_share"] == 0.0
  assert summary["total"]["params"] == sum(g["params"] for g in summary["groups"].values())
  assert summary["ops"] == len(data["ops"]) and summary["quantized_ops"] == 9


def test_text_report_sections():
  text = coverage_format.to_text(_report())
  for fragment in ("Rules:", "[0] .*/gate$  ops=dot_general  w/a/bwd=None/None/None  matches=2",
                   "Unused rules: 2", "Shadowed rules: 2 (by 0, 1)", "Unquantized matmul weights (3):",
                   "decoder/head/kernel", "Quantized share of matmul weights:"):
    assert fragment in text
  gmm_line = next(line for line in text.splitlines() if "gmm(wi_1)" in line and "decoder/layers" in line)
  assert gmm_line.split()[1:4] == ["gmm(wi_1)", "1", "Q"]
  assert "gmm1" not in text  # the lookup ids are named by the expert weight they consume
  assert "einsum0" not in coverage_format.to_text(_report(), show_einsum=False)


def test_markdown_report_tables():
  markdown = coverage_format.to_markdown(_report())
  assert markdown.startswith("# Qwix rule coverage")
  assert "| 0 | `.*/gate$` | dot_general | None | None | None | 2 |" in markdown
  assert "| `decoder/layers/MoeBlock_0` | gmm(wi_0) | 1 | yes |" in markdown
  assert "* Shadowed rules: 2 (by 0, 1)" in markdown


def test_explain_text_shows_regex_and_op_filter_per_rule():
  text = coverage_format.explain_text(coverage_report.explain(_report(), "mtp/proj"))
  assert text.splitlines() == [
      "mtp/proj (op dot_general): rule 1 wins",
      "  recorded ops: dot_general0 -> rule 1",
      "  [0] fullmatch('.*/gate$') no; op 'dot_general' in [dot_general] -> no match",
      "  [1] fullmatch('(decoder/layers.*|mtp/.*)') yes; op 'dot_general' in [dot_general, gmm, ragged_dot] -> WINS",
      "  [2] fullmatch('mtp/.*') yes; op 'dot_general' in [dot_general] -> matches, but rule 1 came first",
  ]


def test_human_numbers():
  assert [coverage_format.human(n) for n in (999, 1_500, 2_000_000, 682_636_472_320)] == [
      "999", "1.50 K", "2.00 M", "682.64 B"]


def test_explain_text_for_an_untraced_module():
  text = coverage_format.explain_text(coverage_report.explain(_report(), "decoder/hed", "dot_general"))
  assert "(no op of this module was traced; did you mean decoder/head or " in text
