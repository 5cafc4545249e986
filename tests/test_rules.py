"""Qwix rule sets: MaxText's builders per quantization mode, settings, and user rule files."""

import dataclasses
import pathlib
import types

import jax.numpy as jnp
import pytest
import qwix
from qwix._src.core import sparsity

from quant import errors, rules

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR) / "qwix"


@pytest.mark.parametrize("quantize_mtp", ["false", "true"])
def test_fp8_full_rule_is_exactly_maxtexts(quantize_mtp):
  built = rules.build_rules(quantization="fp8_full", quantize_mtp=quantize_mtp == "true")
  expected = (DATA / f"deepseek3-tiny_quantize_mtp_{quantize_mtp}_rules.txt").read_text().strip()
  assert len(built) == 1 and isinstance(built[0], qwix.QtRule)
  assert f"rule[0] = {built[0]!r}" == expected


def test_all_switches_give_router_then_logits_then_main_rule():
  built = rules.build_rules(quantization="fp8_full", quantize_mtp=True, quantize_router_proj=False,
                            quantize_logits_proj=True)
  assert [r.module_path for r in built] == [r".*/gate$", "decoder/logits_dense.*", "(decoder/.*layers.*|mtp_block/.*)"]
  router, logits, main = built
  assert (router.weight_qtype, router.act_qtype, router.bwd_qtype, tuple(router.op_names)) == (
      None, None, None, ("dot_general",))
  assert (logits.weight_qtype, logits.act_qtype, logits.bwd_qtype) == (jnp.float8_e4m3fn, jnp.float8_e4m3fn,
                                                                       jnp.float8_e5m2)
  assert tuple(logits.op_names) == ("dot_general",) and logits.additional_qt_config is None
  assert tuple(main.op_names) == ("dot_general", "gmm", "ragged_dot")


def test_logits_calibration_inherits_or_overrides():
  keys = dict(quantization="fp8_full", quantize_logits_proj=True, weight_quantization_calibration_method="fixed,-2,2",
              act_quantization_calibration_method="absmax,0.9")
  inherited = rules.build_rules(**keys)[0]
  assert (inherited.weight_calibration_method, inherited.act_calibration_method) == ("fixed,-2,2", "absmax,0.9")
  override = rules.build_rules(**keys, logits_proj_quant_calibration_method="minmax")[0]
  assert (override.weight_calibration_method, override.act_calibration_method) == ("minmax", "minmax")


def test_drhs_grad_calibration_reaches_main_and_logits_rules():
  built = rules.build_rules(quantization="fp8_full", quantize_logits_proj=True,
                            drhs_grad_quantization_calibration_method="absmax,0.5")
  assert built[0].additional_qt_config == {"drhs_grad_calibration_method": "absmax,0.5"}
  assert built[1].additional_qt_config == {"sparsity_rule": None, "drhs_grad_calibration_method": "absmax,0.5"}


def test_n_m_sparsity_becomes_a_qwix_sparsity_rule():
  main = rules.build_rules(quantization="fp8_full", weight_sparsity_n=2, weight_sparsity_m=4)[0]
  rule = main.additional_qt_config["sparsity_rule"]
  assert isinstance(rule, sparsity.SparsityRule)
  assert (rule.weight_sparsity_n, rule.weight_sparsity_m) == (2, 4)


@pytest.mark.parametrize("mode,qtype", [("int4", jnp.int4), ("int8", jnp.int8), ("fp4", jnp.float4_e2m1fn),
                                        ("fp4_e2m1", jnp.float4_e2m1fn), ("fp8", jnp.float8_e4m3fn),
                                        ("fp8_e4m3", jnp.float8_e4m3fn), ("fp8_e5m2", jnp.float8_e5m2),
                                        ("fp8_gpu", jnp.float8_e4m3fn), ("fp8_nanoo", jnp.float8_e4m3fn)])
def test_single_rule_modes_quantize_only_decoder_dot_generals(mode, qtype):
  (rule,) = rules.build_rules(quantization=mode)
  assert rule.module_path == "decoder/.*layers.*" and tuple(rule.op_names) == ("dot_general",)
  assert rule.weight_qtype is qtype and rule.act_qtype is qtype and rule.bwd_qtype is qtype
  assert rule.bwd_weight_grad_tile_size == 1.0  # quantization_local_shard_count=-1 -> one slice


def test_local_shard_count_sets_backward_tile_and_router_rule_comes_first():
  built = rules.build_rules(quantization="int8", quantization_local_shard_count=4, quantize_router_proj=False)
  assert [r.module_path for r in built] == [r".*/gate$", "decoder/.*layers.*"]
  assert built[1].bwd_weight_grad_tile_size == 0.25


def test_no_quantization_gives_no_rules():
  assert rules.build_rules(rules.QuantSettings()) == []


def test_unknown_quantization_is_a_one_line_error_listing_modes():
  with pytest.raises(errors.QuantError) as info:
    rules.build_rules(quantization="fp9")
  message = str(info.value)
  assert "'fp9'" in message and "'fp8_full'" in message and "\n" not in message


def test_settings_read_by_name_from_any_config_object():
  cfg = types.SimpleNamespace(quantization="fp8_full", quantize_mtp=True, unrelated=1)
  settings = rules.QuantSettings.from_object(cfg)
  assert settings.quantization == "fp8_full" and settings.quantize_mtp and settings.quantize_router_proj


def test_settings_from_the_tools_model_config():
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1", "quantization=fp8_full",
                               "quantize_mtp=true", "quantize_router_proj=false"])
  built = rules.build_rules(rules.QuantSettings.from_object(cfg))
  assert [r.module_path for r in built] == [r".*/gate$", "(decoder/.*layers.*|mtp_block/.*)"]


def test_provider_semantics_of_quantized():
  none_rule = rules.router_unquantized_rule()
  fp8 = rules.build_rules(quantization="fp8")[0]
  assert rules.provider_name("fp8_full") == "qt" and rules.provider_name("fp8_gpu") == "nvidia_fp8"
  assert rules.provider_name("") is None
  assert not rules.quantizes(None, "dot_general")
  assert not rules.quantizes(none_rule, "dot_general", "qt")
  assert rules.quantizes(none_rule, "dot_general", "nvidia_fp8")  # that provider only checks rule is not None
  assert rules.quantizes(fp8, "dot_general", "qt")


def test_qtype_names():
  assert rules.qtype_name(jnp.float8_e4m3fn) == "float8_e4m3fn"
  assert rules.qtype_name("nf4") == "nf4" and rules.qtype_name(None) is None


# Rule files ------------------------------------------------------------------------------------------------

def _write(tmp_path, text):
  path = tmp_path / "rules.yml"
  path.write_text(text)
  return path


def test_rule_file_builds_qt_rules(tmp_path):
  path = _write(tmp_path, """
- module_path: '.*/gate$'
  op_names: dot_general
- module_path: 'decoder/.*layers.*'
  op_names: [dot_general, gmm]
  weight_qtype: float8_e4m3fn
  act_qtype: float8_e4m3fn
  bwd_qtype: float8_e5m2
  weight_calibration_method: fixed,-224,224
  act_batch_axes: [0, 1]
  additional_qt_config:
    sparsity_rule: {weight_sparsity_n: 2, weight_sparsity_m: 4}
- module_path: 'mtp_block/.*'
  weight_qtype: nf4
""")
  gate, main, mtp = rules.load_rule_file(path)
  assert all(isinstance(r, qwix.QtRule) for r in (gate, main, mtp))
  assert tuple(gate.op_names) == ("dot_general",) and gate.weight_qtype is None
  assert main.weight_qtype is jnp.float8_e4m3fn and main.bwd_qtype is jnp.float8_e5m2
  assert main.act_batch_axes == (0, 1) and main.weight_calibration_method == "fixed,-224,224"
  assert main.additional_qt_config["sparsity_rule"] == sparsity.SparsityRule(weight_sparsity_n=2, weight_sparsity_m=4)
  assert mtp.weight_qtype == "nf4" and tuple(mtp.op_names) == ()


def test_rule_records_round_trip_through_the_parser():
  built = rules.build_rules(quantization="fp8_full", quantize_router_proj=False, quantize_logits_proj=True,
                            weight_sparsity_n=2, weight_sparsity_m=4)
  assert rules.parse_rules([rules.rule_record(r) for r in built]) == built


def test_invalid_regex_names_rule_and_field(tmp_path):
  path = _write(tmp_path, "- module_path: 'decoder/.*'\n- module_path: 'decoder/(layers'\n")
  with pytest.raises(errors.QuantError) as info:
    rules.load_rule_file(path)
  message = str(info.value)
  assert "rule 1" in message and "'module_path'" in message and "invalid regex" in message
  assert "\n" not in message


def test_unknown_qtype_names_rule_field_and_accepted_qtypes(tmp_path):
  path = _write(tmp_path, "- module_path: '.*'\n  act_qtype: fp8\n")
  with pytest.raises(errors.QuantError) as info:
    rules.load_rule_file(path)
  message = str(info.value)
  assert "rule 0" in message and "'act_qtype'" in message and "'fp8'" in message
  assert "float8_e4m3fn" in message and "int8" in message and "\n" not in message


def test_unknown_field_suggests_the_closest(tmp_path):
  path = _write(tmp_path, "- module_path: '.*'\n  weight_qtpye: int8\n")
  with pytest.raises(errors.QuantError, match=r"rule 0: unknown field 'weight_qtpye'; did you mean 'weight_qtype'"):
    rules.load_rule_file(path)


@pytest.mark.parametrize("text,fragment", [
    ("- module_path: '.*'\n  weight_calibration_method: maxabs\n", "invalid calibration method 'maxabs'"),
    ("- module_path: '.*'\n  tile_size: -3\n", "'tile_size'"),
    ("- module_path: '.*'\n  additional_qt_config: {sparsity: 1}\n", "unknown DotGeneralQtConfig field 'sparsity'"),
    ("- [not, a, mapping]\n", "rule 0 must be a mapping"),
    ("module_path: '.*'\n", "must hold a YAML list of rules"),
    ("- module_path: [unclosed\n", "is not valid YAML"),
])
def test_bad_rule_files_are_one_line_errors(tmp_path, text, fragment):
  with pytest.raises(errors.QuantError) as info:
    rules.load_rule_file(_write(tmp_path, text))
  assert fragment in str(info.value) and "\n" not in str(info.value)


def test_missing_rule_file(tmp_path):
  with pytest.raises(errors.QuantError, match="does not exist"):
    rules.load_rule_file(tmp_path / "absent.yml")


def test_rule_file_rules_are_frozen_dataclasses(tmp_path):
  (rule,) = rules.load_rule_file(_write(tmp_path, "- module_path: 'x'\n  weight_qtype: int4\n"))
  with pytest.raises(dataclasses.FrozenInstanceError):
    rule.module_path = "y"  # type: ignore[misc]
