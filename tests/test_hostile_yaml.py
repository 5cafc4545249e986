"""Hostile model and rule YAML files, rule regexes and rule fields: one line, exit 2 (issue 13, item 6)."""

import os

import pytest

from quant import errors as quant_errors
from quant import rules
from quant import safe_regex
from quant import yaml_file

from hostile import deny_reading, refused, refused_in_subprocess

BILLION_LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8))


def _write(tmp_path, name: str, content: str | bytes) -> str:
  path = tmp_path / name
  if isinstance(content, bytes):
    path.write_bytes(content)
  else:
    path.write_text(content)
  return str(path)


@pytest.mark.parametrize("content, expected", [
    ("1: 2\n", "key '1' at line 1 is not a string"),
    ("model_name: x\nnull: x\n", "key 'null' at line 2 is not a string"),
    (b"model_name: caf\xe9\n", "is not UTF-8 text (byte 15"),
    ("[" * 60_000 + "]" * 60_000 + "\n", f"nests deeper than {yaml_file.MAX_DEPTH} levels"),
    ("[" * 100_000 + "]" * 100_000 + "\n", f"files over {yaml_file.MAX_BYTES} bytes are refused"),
    (BILLION_LAUGHS, f"expands to over {yaml_file.MAX_NODES} values"),
    ("a: &a [*a]\n", "nests deeper than"),
    ("a: [1, 2\n", "is not valid YAML"),
])
def test_hostile_model_file(capsys, tmp_path, content, expected):
  path = _write(tmp_path, "m.yml", content)
  refused(capsys, ["maxtext", f"model_file={path}"], f"model file {path!r}", expected)


def test_oversized_model_file_is_refused_before_reading(capsys, tmp_path):
  path = tmp_path / "big.yml"
  with open(path, "wb") as f:
    f.truncate(50 << 20)  # 50 MB (sparse): PyYAML took 229 s on such a file
  refused(capsys, ["maxtext", f"model_file={path}"], f"is {50 << 20} bytes; files over {yaml_file.MAX_BYTES} bytes")


def test_unreadable_model_file(capsys, tmp_path, monkeypatch):
  path = _write(tmp_path, "m.yml", "model_name: deepseek3-tiny\n")
  deny_reading(monkeypatch, path)
  refused(capsys, ["maxtext", f"model_file={path}"], "cannot be read: Permission denied")


def test_directory_as_model_file(capsys, tmp_path):
  refused(capsys, ["maxtext", f"model_file={tmp_path}"], "is a directory, not a file")


def test_fifo_as_model_file_does_not_block(tmp_path):
  fifo = tmp_path / "m.yml"
  os.mkfifo(fifo)
  refused_in_subprocess(["maxtext", f"model_file={fifo}"], "is not a regular file", timeout=60)


@pytest.mark.parametrize("content, expected", [
    ("- {1: 2}\n", "key '1' at line 1 is not a string"),
    (b"- module_path: '\xff'\n", "is not UTF-8 text"),
    (BILLION_LAUGHS, "expands to over"),
    ("- module_path: 5\n", "rule 0 field 'module_path': expected a regex string, got 5"),
    ("- op_names: [1]\n", "expected a list of op names"),
    ("- weight_qtype: 8\n", "unknown qtype 8"),
    ("- tile_size: .inf\n", "expected a positive int (tile size) or float (1/tile count), got inf"),
    ("- tile_size: .nan\n", "got nan"),
    ("- tile_size: true\n", "got True"),
    ("- act_static_scale: 'yes'\n", "expected true or false or null, got 'yes'"),
    ("- disable_channelwise_axes: null\n", "expected true or false, got None"),
    ("- weight_calibration_method: 'absmax,nan'\n", "invalid calibration method 'absmax,nan'"),
    ("- act_batch_axes: [0, x]\n", "expected a list of axis integers"),
    ("- additional_qt_config: {lhs_collect_quant_stat: print}\n", "only null can be given in a rule file"),
    ("- additional_qt_config: {disable_gradient_clipping: 'no'}\n", "disable_gradient_clipping: expected true or false"),
    ("- additional_qt_config: {drhs_tile_size: -1}\n", "drhs_tile_size: expected a positive int"),
    ("- additional_qt_config: {sparsity_rule: {weight_sparsity_n: '2'}}\n", "expected an integer >= 0, got '2'"),
    ("- additional_qt_config: {sparsity_rule: {eval_mode: 1}}\n", "eval_mode: expected true or false, got 1"),
    ("- additional_qt_config: {sparsity_rule: {weight_sparsity_order: X}}\n", "expected 'R' (rows) or 'C'"),
])
def test_hostile_rule_file(tmp_path, content, expected):
  path = _write(tmp_path, "r.yml", content)
  with pytest.raises(quant_errors.QuantError) as info:
    rules.load_rule_file(path)
  message = str(info.value)
  assert "\n" not in message and expected in message and repr(path) in message, message


@pytest.mark.parametrize("pattern, why", [
    ("(.|.)*Z", "alternatives that can match the same text"),
    ("(a|a)*Z", "alternatives that can match the same text"),
    ("(a+)+b", "a repetition inside a repetition"),
    ("(x.*)*Z", "a repetition inside a repetition"),
    ("(\\d+|x)+y", "a repetition inside a repetition"),
    (".*.*.*.*.*.*.*Z", f"took over {safe_regex.PROBE_SECONDS} s"),  # polynomial: ~n^7 steps on a long path
])
def test_catastrophic_module_path_is_refused_not_run(tmp_path, pattern, why):
  path = _write(tmp_path, "r.yml", f"- module_path: '{pattern}'\n  weight_qtype: float8_e4m3fn\n")
  code = ("import sys; from quant import rules, errors\n"
          f"try:\n  rules.load_rule_file({path!r})\nexcept errors.QuantError as e:\n  print(e); sys.exit(2)\n")
  import subprocess  # pylint: disable=import-outside-toplevel
  import sys  # pylint: disable=import-outside-toplevel
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 2, result.stderr[-2000:]
  assert "may backtrack catastrophically" in result.stdout and why in result.stdout, result.stdout


@pytest.mark.parametrize("pattern", [
    rules.DECODER_LAYERS_PATH, rules.DECODER_AND_MTP_PATH, rules.ROUTER_PATH, rules.LOGITS_PATH, ".*",
    "(\\w+/)*gate", "([^/]+/)*gate", "(?:ab|ac)*", "(a|b)*c", "decoder/(dense|moe)_layers/.*/wi_[01]",
])
def test_ordinary_module_paths_are_accepted(pattern):
  assert safe_regex.check(pattern).pattern == pattern


def test_rule_file_refusal_through_the_cli(capsys, tmp_path):
  path = _write(tmp_path, "r.yml", "- module_path: '(.|.)*Z'\n")
  refused(capsys, ["rules", "model_name=deepseek3-tiny", "--rules", path], "rule 0 field 'module_path'",
          "may backtrack catastrophically")


def test_explain_of_an_untraced_module_names_the_closest(capsys):
  line = refused(capsys, ["rules", "model_name=deepseek3-tiny", "quantization=fp8_full", "--explain",
                          "decoder/moe_layers/self_attention/ot"], "--explain 'decoder/moe_layers/self_attention/ot'")
  assert "closest: 'decoder/moe_layers/self_attention/out'" in line
  line = refused(capsys, ["rules", "model_name=deepseek3-tiny", "--explain", "no/such/module"],
                 "no traced op has this module path; closest: '")


def test_regex_probe_leaves_the_callers_alarm_alone():
  import signal  # pylint: disable=import-outside-toplevel

  def handler(*_):
    raise AssertionError("the caller's alarm fired during the probe")

  previous = signal.signal(signal.SIGALRM, handler)
  try:
    safe_regex.check("decoder/.*layers.*")
    assert signal.getsignal(signal.SIGALRM) is handler
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
  finally:
    signal.signal(signal.SIGALRM, previous)
