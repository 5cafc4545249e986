"""The CLI resolves a command's model configuration and its checkpoint once and hands the resolved objects down
(`run.weights.Weights`, `hf_import.inputs.Inputs`): `export`, `forward` and `import` neither parse the keys again
nor look the checkpoint up again, so a step written into a directory of steps while a command runs is not taken
halfway through it."""

import collections
import json
import os
import shutil

import pytest

from inspect_tool.checkpoint import locate
from inspect_tool.configuration import config as config_lib
from inspect_tool.hf import config as hf_config
from inspect_tool.streaming import read

from conftest import DATA
from conftest import run_cli

CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]


@pytest.fixture
def counted(monkeypatch):
  """How often the keys were resolved (by their tokens) and each path looked up as an Orbax checkpoint."""
  counts = collections.Counter()
  resolve_config, resolve_orbax_path = config_lib.resolve_config, locate.resolve_orbax_path

  def config_once(tokens=(), **extra):
    tokens = list(tokens)
    counts[("config", tuple(tokens))] += 1
    return resolve_config(tokens, **extra)

  def path_once(path):
    counts[("path", os.path.abspath(path))] += 1
    return resolve_orbax_path(path)

  monkeypatch.setattr(config_lib, "resolve_config", config_once)
  monkeypatch.setattr(locate, "resolve_orbax_path", path_once)
  return counts


def test_forward_resolves_its_keys_and_its_checkpoint_once(counted, capsys):
  code, out, err = run_cli(capsys, "forward", *L4, "--checkpoint", CKPT, "--quiet")
  assert code == 0, err
  assert f"weights: Orbax checkpoint {os.path.abspath(CKPT)}/0/items (step 0)" in out.splitlines()
  assert counted == {("config", tuple(L4)): 1, ("path", os.path.abspath(CKPT)): 1}  # measured before: 1 and 2


def test_export_resolves_its_keys_and_its_source_once(counted, capsys, tmp_path):
  keys = L4 + ["quantization=fp8_full"]
  code, _, err = run_cli(capsys, "export", *keys, "--checkpoint", CKPT, "--output", tmp_path / "fp8", "--quiet")
  assert code == 0, err
  looked_up = {path: n for (kind, path), n in counted.items() if kind == "path"}
  assert counted[("config", tuple(keys))] == 1  # measured before: 3
  assert looked_up.pop(os.path.abspath(CKPT)) == 1  # measured before: 3 (the words, the reads, the validation)
  assert looked_up == {}  # the validation reads the export back where its writer put it (measured before: 1)


def test_import_reads_the_directory_s_keys_and_resolves_its_config_once(counted, capsys, tmp_path, monkeypatch):
  derived = collections.Counter()
  derive_keys = hf_config.derive_keys

  def derive_once(path):
    derived[path] += 1
    return derive_keys(path)

  monkeypatch.setattr(hf_config, "derive_keys", derive_once)
  source, dst = os.path.join(DATA, "import", "hf_small"), tmp_path / "imported"
  code, _, err = run_cli(capsys, "import", "--path", source, "--output", dst, "--quiet", "weight_dtype=bfloat16")
  assert code == 0, err
  keys = json.loads((dst / "import_report.json").read_text())["maxtext_keys"]
  assert "weight_dtype=bfloat16" in keys  # the user's key: the import's keys are not config.json's own
  assert derived == {os.path.abspath(source): 1}  # measured before: 4
  assert counted[("config", tuple(keys))] == 1  # measured before: 4 (config.json's own keys, compared, apart)


def test_a_step_written_while_the_export_runs_is_not_read(tmp_path, capsys, monkeypatch):
  """The export is given a directory of steps: it takes the latest, step 1. Step 2 appears (here: incomplete, its
  arrays missing) after the command named its weights and before the arrays are opened; the arrays come from step 1
  (looked up again, as before, step 2 was taken and its reads failed)."""
  steps = tmp_path / "steps"
  shutil.copytree(os.path.join(CKPT, "0"), steps / "1")
  open_source = read.open_source

  def meanwhile(*args, **kwargs):
    shutil.copytree(steps / "1", steps / "2", ignore=shutil.ignore_patterns("d", "ocdbt.process_*"))
    return open_source(*args, **kwargs)

  monkeypatch.setattr(read, "open_source", meanwhile)
  code, out, err = run_cli(capsys, "export", *L4, "quantization=fp8_full", "--checkpoint", steps, "--output",
                           tmp_path / "fp8", "--quiet", "--no-validate")
  assert code == 0, err
  assert (steps / "2").is_dir()
  assert out.startswith(f"weights: Orbax checkpoint {steps}/1/items (step 1)")
