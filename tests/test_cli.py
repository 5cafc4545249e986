"""The command line: help everywhere without JAX, MaxText spellings, exit codes and one-line errors."""

import gc
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from inspect_tool import cli
from inspect_tool.cli import options

from conftest import REPO
from conftest import DATA
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


def test_the_command_s_process_collects_garbage_less_often():
  """`inspect_checkpoint` (`cli.entry_point`) runs its command under `cli.GC_THRESHOLDS`, not Python's defaults."""
  code = ("import gc; from inspect_tool import cli; "
          "cli.main = lambda **kw: print(*gc.get_threshold()) or 0; cli.entry_point()")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
  assert result.returncode == 0 and result.stdout.split() == [str(n) for n in cli.GC_THRESHOLDS], result.stderr
  assert cli.GC_THRESHOLDS != (700, 10, 10)  # Python's defaults


def test_the_command_s_process_freezes_what_its_command_imported():
  """`entry_point` freezes the objects of the command's imports out of the collector's scans (`gc.freeze`); a
  command run in-process (`cli.main`, as the tests do) leaves the caller's collector alone."""
  code = ("import atexit, gc, sys; from inspect_tool import cli; "
          "atexit.register(lambda: print('FROZEN', gc.get_freeze_count(), file=sys.stderr)); "
          "sys.argv = ['inspect_checkpoint', 'presets']; cli.entry_point()")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False)
  frozen = [int(line.split()[1]) for line in result.stderr.splitlines() if line.startswith("FROZEN ")]
  assert result.returncode == 0 and frozen and frozen[0] > 10_000, result.stderr[-2000:]
  before = gc.get_freeze_count()
  assert cli.main(["presets"]) == 0
  assert gc.get_freeze_count() == before


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
  lines = out.strip().splitlines()
  assert code == 1 and "scan_layers=true" in out and lines[-2].startswith("DISAGREE")
  assert lines[-1] == f"try: inspect_checkpoint diff {' '.join(REF_TINY)} scan_layers=true --path {CKPT_ITEMS}"
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


# ----------------------------------------------------------------------------------------------------------------
# One consistent command line (issue 24): every rule below is checked on every command, by introspection.

def _commands():
  return {name: cli.cli.get_command(None, name) for name in cli._COMMANDS}  # pylint: disable=protected-access


def _parse(name, *args):
  """The command's context after the group's argument handling (what a real run would see)."""
  import click  # pylint: disable=import-outside-toplevel
  group_ctx = click.Context(cli.cli, info_name="inspect_checkpoint")
  command = _commands()[name]
  required = [a for p in command.params if isinstance(p, click.Option) and p.required for a in (p.opts[0], "x")]
  positional = ["x" for p in command.params if isinstance(p, click.Argument) and p.required]  # verify's DST
  _, _, rest = cli.cli.resolve_command(group_ctx, [name, *positional, *required, *args])
  return command.make_context(name, rest, parent=group_ctx)


def _boolean_flags():
  import click  # pylint: disable=import-outside-toplevel
  for name, command in _commands().items():
    for param in command.params:
      if isinstance(param, click.Option) and param.is_flag and param.is_bool_flag:
        yield name, param


def _value(ctx, param):
  return ctx.meta[f"inspect_checkpoint.{param.name}"] if not param.expose_value else ctx.params[param.name]


def test_every_boolean_flag_of_every_command_takes_maxtext_true_and_false():
  flags = list(_boolean_flags())
  assert len(flags) >= 25 and {p.name for _, p in flags} >= {"strict", "include_all", "overwrite", "validate"}
  for name, param in flags:
    for value in (True, False):
      for spelling in param.opts:
        for text in (("true", "1", "True") if value else ("false", "0", "FALSE")):
          assert _value(_parse(name, f"{spelling}={text}"), param) is value, (name, spelling, text)
      for spelling in param.secondary_opts:  # --no-x=true is --no-x
        assert _value(_parse(name, f"{spelling}={'true' if value else 'false'}"), param) is (not value)
    if not param.secondary_opts:  # off by default; the last spelling wins
      assert _value(_parse(name), param) is False
      assert _value(_parse(name, param.opts[0], f"{param.opts[0]}=false"), param) is False


def test_strict_false_and_all_false_run(capsys):
  code, out, err = run(capsys, "maxtext", *TINY, "--all=false", "--summary=false", "--check_dtype=false")
  assert code == 0 and err == "" and "MoeBlock_0.gate.bias" not in out and "dtype" not in out
  code, _, err = run(capsys, "rules", *TINY, "--strict=maybe")
  assert code == 2 and "--strict" in err and len(err.strip().splitlines()) == 1


def _help_records(name):
  import click  # pylint: disable=import-outside-toplevel
  command = _commands()[name]
  ctx = click.Context(command, info_name=name)
  return command, [(p, p.get_help_record(ctx)) for p in command.params if isinstance(p, click.Option)]


@pytest.mark.parametrize("name", list(cli._COMMANDS))  # pylint: disable=protected-access
def test_help_names_only_options_the_command_has(name):
  command, records = _help_records(name)
  own = {o for p in command.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
  texts = [record[1] for _, record in records if record] + [command.help or "", command.epilog or ""]
  # an option named after another command's name is that command's (`maxtext --topology`)
  named = {opt for text in texts for before, opt in re.findall(r"(\w*) ?(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])", text)
           if before not in set(cli._COMMANDS) - {name}}  # pylint: disable=protected-access
  assert named - own == set(), f"{name}'s help names options it does not have"
  for param, record in records:  # --overwrite names every output file option of its command
    if param.name == "overwrite":
      outputs = [p.opts for p in command.params if isinstance(p.type, options.OutputPath)]
      assert outputs and all(any(o in record[1] for o in opts) for opts in outputs), (name, record[1])


@pytest.mark.parametrize("name", list(cli._COMMANDS))  # pylint: disable=protected-access
def test_paths_are_click_paths_and_every_command_reports_alike(name):
  import click  # pylint: disable=import-outside-toplevel
  command = _commands()[name]
  for param in command.params:
    help_text = getattr(param, "help", None) or ""
    if param.type is click.STRING:
      assert not re.search(r"\b(files?|director(y|ies)|checkpoints?)\b|\.npy|\.npz|safetensors", help_text), (
          name, param.name)
  opts = {o for p in command.params for o in getattr(p, "opts", [])}
  assert {"--format", "--output_file"} <= opts, name
  assert ("--html" in opts) == (name in ("maxtext", "orbax", "hf", "rules")), name


def test_bare_command_is_help_and_success(capsys):
  code, out, err = run(capsys)
  assert code == 0 and err == "" and out.startswith("Usage: inspect_checkpoint") and "Commands:" in out
  diff_line = next(line for line in out.splitlines() if line.strip().startswith("diff "))
  assert "Orbax" in diff_line and "HF" in diff_line
  assert all(re.search(rf"^  {n} ", out, re.M) for n in cli._COMMANDS)  # pylint: disable=protected-access
  code, _, err = run(capsys, "rulez")
  assert code == 2 and "Did you mean 'rules'?" in err


# Examples run from the repository root as printed; forward, export and import build and run the model (tests of
# their own cover them).
RUN_EXAMPLES = ("maxtext", "orbax", "hf", "diff", "rules", "presets", "keys", "topologies")


@pytest.mark.parametrize("name", list(cli._COMMANDS))  # pylint: disable=protected-access
def test_every_command_help_shows_an_example_that_runs(capsys, tmp_path, monkeypatch, name):
  code, out, _ = run(capsys, name, "--help")
  example = re.search(r"^  Example:\n    (inspect_checkpoint .*)$", out, re.M)
  assert code == 0 and example and example.group(1).startswith(f"inspect_checkpoint {name}")
  if name not in RUN_EXAMPLES:
    return
  (tmp_path / "tests").symlink_to(os.path.join(REPO, "tests"))  # outputs land in tmp_path
  monkeypatch.chdir(tmp_path)
  command, _, grep = example.group(1).partition(" | grep ")
  code, out, err = run(capsys, *shlex.split(command)[1:])
  assert code == 0, err
  assert not grep or grep in out


def test_rules_html_file_like_maxtext_and_output_file(capsys, tmp_path):
  page, report = tmp_path / "coverage.html", tmp_path / "coverage.txt"
  code, out, _ = run(capsys, "rules", *TINY, "quantization=fp8_full", "--html", str(page), "--output_file",
                     str(report))
  assert code == 0 and out and "<html" not in out.lower()
  assert report.read_text() == out and "<html" in page.read_text()[:500].lower()
  assert "rule 0 (float8_e4m3fn)" in page.read_text() and 'src="http' not in page.read_text()
  code, out, err = run(capsys, "rules", *TINY, "--html", str(page))
  assert code == 2 and out == "" and "--overwrite" in err and "rule 0 (float8_e4m3fn)" in page.read_text()


def test_explain_takes_the_dotted_keys_listings_print(capsys):
  slash = "mtp_block/mtp_layer_1/mtp_1_transformer_layer/self_attention/out"
  code, by_module, _ = run(capsys, "rules", *TINY, "quantization=fp8_full", "--explain", slash)
  assert code == 0 and "no rule matches" in by_module
  for spelling in ("params.params." + slash.replace("/", ".") + ".kernel", slash.replace("/", "."), slash + "/kernel"):
    code, out, err = run(capsys, "rules", *TINY, "quantization=fp8_full", "--explain", spelling)
    assert (code, out) == (0, by_module), (spelling, err)


def test_diff_output_file_is_the_report(capsys, tmp_path):
  target = tmp_path / "diff.json"
  code, out, _ = run(capsys, "diff", *REF_TINY, "--path", CKPT_ITEMS, "--format", "json", "--output_file",
                     str(target))
  assert code == 0 and target.read_text() == out and json.loads(out)["agree"]


def test_export_output_file_is_its_report_and_overwrite_covers_it(capsys, tmp_path):
  report, dst = tmp_path / "report.json", tmp_path / "out"
  report.write_text("kept")
  argv = ["export", *REF_TINY, "quantization=fp8_full", "--checkpoint", CKPT_ITEMS, "--output", str(dst),
          "--no-validate", "--format", "json", "--output_file", str(report)]
  code, out, err = run(capsys, *argv)
  assert code == 2 and out == "" and "--overwrite" in err and report.read_text() == "kept" and not dst.exists()
  code, out, err = run(capsys, *argv, "--overwrite")
  assert code == 0, err
  assert report.read_text() == out and json.loads(out) == json.loads((dst / "quantization_report.json").read_text())
