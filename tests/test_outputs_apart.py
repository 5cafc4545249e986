"""No command writes an output onto or inside one of its inputs, or onto another of its outputs, with or without
--overwrite (issue 51, item 1): `verify DST --output-file DST/export_manifest.json --overwrite` replaced the manifest
with its one-line report, `import --output-file SRC/config.json --overwrite` the source's config.json. One rule
(`output.destination.check_apart`) for every output of every command: one line, exit 2, every input unchanged."""

import os
import shutil

import click
import numpy as np
import pytest

from hostile import REF_CKPT, REPO, TINY_CKPT_MODEL, refused
from test_destination import _snapshot
from inspect_tool import cli
from inspect_tool.cli import options

HF_SMALL = os.path.join(REPO, "tests", "data", "import", "hf_small")
TINY = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=2",
        "first_num_dense_layers=1", "vocab_size=256"]


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory):
  """A real export (DeepSeek FP8 layout, not validated) that `verify` passes."""
  dst = tmp_path_factory.mktemp("export") / "dst"
  code = cli.main(["export", *TINY_CKPT_MODEL, "quantization=fp8_full", "--checkpoint", REF_CKPT, "--output", str(dst),
                   "--layout", "deepseek-fp8", "--no-validate", "--quiet"])
  assert code == 0
  return dst


def _refused_unchanged(capsys, root, argv, *expected):
  """`argv` with and without --overwrite: one line naming what is refused, nothing under `root` changed."""
  before = _snapshot(root)
  for extra in ([], ["--overwrite"]):
    refused(capsys, [*argv, *extra], *expected)
    assert _snapshot(root) == before


@pytest.mark.parametrize("target", ["export_manifest.json", "model-00001-of-00001.safetensors", "notes.txt"])
def test_verify_never_writes_its_report_into_the_export(capsys, tmp_path, export_dir, target):
  dst = tmp_path / "dst"
  shutil.copytree(export_dir, dst)
  assert cli.main(["verify", str(dst)]) == 0  # the export verifies
  capsys.readouterr()
  output = str(dst / target)
  _refused_unchanged(capsys, tmp_path, ["verify", str(dst), "--output-file", output],
                     f"--output-file {output!r} lies inside the export {str(dst)!r} (DST)")
  assert cli.main(["verify", str(dst)]) == 0  # still verifies
  capsys.readouterr()


@pytest.mark.parametrize("target", ["config.json", "model.safetensors.index.json", "new.txt"])
def test_import_never_writes_its_report_into_the_source(capsys, tmp_path, target):
  src = tmp_path / "src"
  shutil.copytree(HF_SMALL, src)
  output = str(src / target)
  _refused_unchanged(capsys, tmp_path, ["import", "--path", str(src), "--output", str(tmp_path / "dst"),
                                        "--output-file", output],
                     f"--output-file {output!r} lies inside the source {str(src)!r} (--path)")


def test_import_never_writes_its_report_into_its_output_directory(capsys, tmp_path):
  dst = tmp_path / "dst"
  output = str(dst / "import_report.json")
  _refused_unchanged(capsys, tmp_path, ["import", "--path", HF_SMALL, "--output", str(dst), "--output-file", output],
                     f"lies inside the output directory {str(dst)!r} (--output)")


@pytest.mark.parametrize("option", ["--tokens", "--targets"])
def test_export_never_writes_onto_or_around_its_token_files(capsys, tmp_path, option):
  data = tmp_path / "data"
  data.mkdir()
  np.save(data / "t.npy", np.zeros((2, 16), np.int32))
  given = str(data / "t.npy")
  base = ["export", *TINY_CKPT_MODEL, "quantization=fp8_full", "--checkpoint", REF_CKPT, option, given]
  _refused_unchanged(capsys, tmp_path, [*base, "--output", str(tmp_path / "dst"), "--output-file", given],
                     f"--output-file {given!r} is the {option[2:]} file {given!r} ({option})")
  _refused_unchanged(capsys, tmp_path, [*base, "--output", str(data)],
                     f"output {str(data)!r} contains the {option[2:]} file {given!r} ({option})")


def test_export_never_writes_its_report_into_its_export(capsys, tmp_path):
  dst = tmp_path / "dst"
  output = str(dst / "export_manifest.json")
  _refused_unchanged(capsys, tmp_path, ["export", *TINY_CKPT_MODEL, "quantization=fp8_full", "--checkpoint", REF_CKPT,
                                        "--output", str(dst), "--output-file", output],
                     f"--output-file {output!r} lies inside the output directory {str(dst)!r} (--output)")


def test_export_compile_never_writes_into_its_source(capsys, tmp_path):
  src = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, src)
  output = str(src / "0" / "report.txt")
  _refused_unchanged(capsys, tmp_path, ["export", *TINY_CKPT_MODEL, "--checkpoint", str(src), "--compile",
                                        "--topology", "v5p-8", "--output-file", output],
                     f"--output-file {output!r} lies inside the source {str(src)!r} (--checkpoint)")


@pytest.mark.parametrize("option", ["--save-logits", "--output-file"])
@pytest.mark.parametrize("input_option", ["--tokens", "--targets"])
def test_forward_never_writes_onto_its_token_files(capsys, tmp_path, option, input_option):
  given = str(tmp_path / "t.npy")
  np.save(given, np.zeros((2, 16), np.int32))
  _refused_unchanged(capsys, tmp_path, ["forward", *TINY, input_option, given, option, given],
                     f"{option} {given!r} is the {input_option[2:]} file {given!r} ({input_option})")


def test_forward_never_writes_into_its_checkpoint_or_onto_its_other_output(capsys, tmp_path):
  src = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, src)
  output = str(src / "0" / "_CHECKPOINT_METADATA")
  _refused_unchanged(capsys, tmp_path, ["forward", *TINY_CKPT_MODEL, "--checkpoint", str(src), "--save-logits", output],
                     f"--save-logits {output!r} lies inside the source {str(src)!r} (--checkpoint)")
  same = str(tmp_path / "out.npz")
  _refused_unchanged(capsys, tmp_path, ["forward", *TINY, "--save-logits", same, "--output-file", same],
                     f"--save-logits {same!r} is the output file {same!r} (--output-file)")


@pytest.mark.parametrize("command", ["orbax", "diff"])
def test_orbax_and_diff_never_write_into_their_checkpoint(capsys, tmp_path, command):
  src = tmp_path / "ckpt"
  shutil.copytree(REF_CKPT, src)
  output = str(src / "0" / "items" / "_METADATA")
  keys = TINY_CKPT_MODEL if command == "diff" else []
  _refused_unchanged(capsys, tmp_path, [command, *keys, "--path", str(src), "--output-file", output],
                     f"--output-file {output!r} lies inside the source {str(src)!r} (--path)")


@pytest.mark.parametrize("given", ["dir", "index"])
def test_hf_never_writes_beside_the_shards_it_lists(capsys, tmp_path, given):
  src = tmp_path / "src"
  shutil.copytree(HF_SMALL, src)
  path = str(src if given == "dir" else src / "model.safetensors.index.json")
  output = str(src / "model-00002-of-00002.safetensors")
  what = "the source" if given == "dir" else "the directory of the index"
  for option in ("--output-file", "--html"):
    _refused_unchanged(capsys, tmp_path, ["hf", "--path", path, option, output],
                       f"{option} {output!r} lies inside {what} {str(src)!r} (--path)")
  _refused_unchanged(capsys, tmp_path, ["hf", "--path", path, "--output-file", str(tmp_path / "a.txt"), "--html",
                                        str(tmp_path / "a.txt")], "is the output file")


def test_rules_and_maxtext_never_write_onto_their_model_or_rules_file(capsys, tmp_path):
  model = tmp_path / "m.yml"
  model.write_text("model_name: deepseek3-tiny\nbase_emb_dim: 64\n")
  rules_file = tmp_path / "r.yml"
  rules_file.write_text("- module_path: '.*'\n  weight_qtype: float8_e4m3fn\n")
  for command in ("maxtext", "rules"):
    for token in (str(model), f"model_file={model}"):
      _refused_unchanged(capsys, tmp_path, [command, token, "--output-file", str(model)],
                         f"--output-file {str(model)!r} is the model file {str(model)!r} (key=value)")
  _refused_unchanged(capsys, tmp_path, ["rules", "model_name=deepseek3-tiny", "--rules", str(rules_file), "--html",
                                        str(rules_file)],
                     f"--html {str(rules_file)!r} is the rules file {str(rules_file)!r} (--rules)")


def test_a_link_into_an_input_is_seen_through(capsys, tmp_path):
  """An output path that reaches an input through a symbolic link to its directory is that input."""
  src = tmp_path / "src"
  shutil.copytree(HF_SMALL, src)
  (tmp_path / "elsewhere").symlink_to(src)
  output = str(tmp_path / "elsewhere" / "config.json")
  _refused_unchanged(capsys, tmp_path, ["hf", "--path", str(src), "--output-file", output], "lies inside the source")


def test_outputs_beside_the_inputs_are_written(capsys, tmp_path):
  """The rule refuses only what overlaps: a report next to the source, not inside it, is written."""
  src = tmp_path / "src"
  shutil.copytree(HF_SMALL, src)
  assert cli.main(["hf", "--path", str(src), "--output-file", str(tmp_path / "src.txt")]) == 0
  assert "key: model.norm.weight | shape: (128,)" in (tmp_path / "src.txt").read_text()
  capsys.readouterr()


def _commands():
  group = cli.cli
  return {name: group.get_command(None, name) for name in group.list_commands(None)}


def test_every_path_a_command_takes_is_an_input_or_an_output():
  """So that the rule reaches every command: a path option that is neither would escape it."""
  for name, command in _commands().items():
    for param in command.params:
      if isinstance(param.type, click.Path):
        assert isinstance(param.type, (options.InputPath, options.OutputPath, options.OutputDirectory)), \
            (name, param.name)
