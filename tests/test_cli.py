"""The command line: help everywhere without JAX, MaxText spellings, exit codes and one-line errors."""

import os
import subprocess
import sys

import pytest

from inspect_tool import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "tests", "data")
CKPT_ITEMS = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024", "0", "items")


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.parametrize("command", list(cli._COMMANDS))  # pylint: disable=protected-access
def test_every_command_has_help(capsys, command):
  code, out, _ = run(capsys, command, "--help")
  assert code == 0 and "Usage:" in out


def test_help_does_not_import_jax():
  code = ("import sys; from inspect_tool import cli; rc = cli.main(['--help']); "
          "assert rc == 0; assert 'jax' not in sys.modules, 'jax imported'")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
  assert result.returncode == 0, result.stderr


def test_python_dash_m_runs_the_cli():
  result = subprocess.run([sys.executable, "-m", "inspect_tool", "--help"], capture_output=True, text=True, cwd=REPO,
                          check=False)
  assert result.returncode == 0 and "maxtext" in result.stdout


def test_normalize_maxtext_boolean_spellings():
  assert cli.normalize_argv(["--check_dtype=true", "--check_dtype=False", "--all=1", "x=y"]) == [
      "--check-dtype", "--no-check-dtype", "--all", "x=y"]


@pytest.mark.parametrize("argv,message", [
    (["maxtext", "model_name=nope"], "unknown model_name 'nope'"),
    (["maxtext", "model_name=deepseek3-tiny", "mtp_num_layer=1"], "did you mean 'mtp_num_layers'"),
    (["maxtext", "scan_layers=perhaps"], "not a boolean"),
    (["maxtext", "mtp_num_layers"], "not of the form key=value"),
    (["maxtext", "model_name=default", "base_emb_dim=-4"], "base_emb_dim=-4 must be a positive integer"),
    (["maxtext", "mtp_num_layers=1"], "no model given: pass model_name="),
    (["orbax", "--path", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
])
def test_bad_input_exits_2_with_one_line(capsys, argv, message):
  code, out, err = run(capsys, *argv)
  assert code == 2 and out == ""
  assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_orbax_listing_is_maxtext_listing(capsys, tmp_path):
  target = tmp_path / "listing.txt"
  code, out, _ = run(capsys, "orbax", "--path", CKPT_ITEMS, "--check_dtype=true", f"--output_file={target}")
  assert code == 0
  with open(os.path.join(DATA, "listings", "orbax_ckpt_deepseek3-tiny-L4-V1024.txt"), encoding="utf-8") as f:
    expected = f.read().splitlines()[2:]
  assert target.read_text().splitlines()[2:] == expected
  assert target.read_text().startswith("# inspect_checkpoint ")
  assert out.splitlines()[:-2] == expected and out.splitlines()[-2].startswith("Total Parameters: ")


TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1"]


def test_forward_refuses_bad_tokens_before_building_anything(capsys, tmp_path):
  import numpy as np  # pylint: disable=import-outside-toplevel
  np.save(tmp_path / "t.npy", np.full((2, 4), 200000, np.int32))
  code, out, err = run(capsys, "forward", *TINY, "--tokens", str(tmp_path / "t.npy"))
  assert code == 2 and out == "" and "outside the vocabulary [0, 129279]" in err
  np.save(tmp_path / "long.npy", np.zeros((1, 64), np.int32))
  code, _, err = run(capsys, "forward", *TINY, "max_target_length=32", "--tokens", str(tmp_path / "long.npy"))
  assert code == 2 and "max_target_length=32" in err


def test_rules_strict_exit_codes_and_explain(capsys, tmp_path):
  code, out, _ = run(capsys, "rules", *TINY, "quantization=fp8_full", "quantize_mtp=true", "--strict", "--format",
                     "json")
  assert code == 0 and '"schema_version": 1' in out
  rules_file = tmp_path / "rules.yml"
  rules_file.write_text("- module_path: 'decoder/.*layers.*'\n  weight_qtype: float8_e4m3fn\n  op_names: [dot_general]\n"
                        "- module_path: 'nothing/.*'\n  weight_qtype: float8_e4m3fn\n")
  code, _, err = run(capsys, "rules", *TINY, "--rules", str(rules_file), "--strict")
  assert code == 1 and "rule 1" in err and "unused" in err
  code, out, _ = run(capsys, "rules", *TINY, "quantization=fp8_full", "--explain",
                     "mtp_block/mtp_layer_1/mtp_1_transformer_layer/self_attention/out")
  assert code == 0 and "no rule matches" in out


@pytest.mark.parametrize("argv,message", [
    (["rules", "model_name=deepseek3-tiny", "quantize_mtp=true", "quantization=fp8_full"], "mtp_num_layers > 0"),
    (["rules", "model_name=deepseek3-tiny", "quantization=fp16"], "quantization='fp16'; accepted"),
])
def test_rules_bad_settings(capsys, argv, message):
  code, _, err = run(capsys, *argv)
  assert code == 2 and message in err and len(err.strip().splitlines()) == 1


REF_TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
            "first_num_dense_layers=1", "vocab_size=1024"]


def test_diff_agrees_with_matching_overrides_and_explains_mismatches(capsys):
  import json  # pylint: disable=import-outside-toplevel
  code, out, _ = run(capsys, "diff", *REF_TINY, "--path", os.path.dirname(CKPT_ITEMS), "--format", "json")
  data = json.loads(out)
  assert code == 0 and data["agree"] and data["schema_version"] == 1 and data["matched"] == 53
  code, out, _ = run(capsys, "diff", *REF_TINY, "scan_layers=false", "--path", CKPT_ITEMS)
  assert code == 1 and "scan_layers=true" in out and out.strip().splitlines()[-1].startswith("DISAGREE")
  code, out, _ = run(capsys, "diff", *REF_TINY[:1], "override_model_config=true", "base_num_decoder_layers=4",
                     "first_num_dense_layers=1", "vocab_size=1024", "--path", CKPT_ITEMS)
  assert code == 1 and "mtp_num_layers=1" in out


def test_rules_html_marks_modules_with_their_winning_rule(capsys):
  code, out, _ = run(capsys, "rules", *TINY, "quantization=fp8_full", "quantize_mtp=false", "--format", "html")
  assert code == 0 and "<html" in out[:500].lower()
  assert "rule 0 (float8_e4m3fn)" in out and "unquantized" in out and "MoeBlock_0" in out
  assert 'src="http' not in out and 'href="http' not in out


@pytest.mark.parametrize("argv,message", [
    (["maxtext", "model_name=deepseek3-tiny", "--format", "xml"], "'xml' is not one of"),
    (["orbax"], "Missing option '--path'"),
    (["bogus"], "No such command 'bogus'"),
])
def test_click_usage_errors_are_one_line_too(capsys, argv, message):
  code, out, err = run(capsys, *argv)
  assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1
