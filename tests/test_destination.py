"""What an output may be: never a source, its steps directory, the working directory or foreign data; one run
per destination at a time; temporaries of killed runs reclaimed (and only those)."""

import json
import os
import subprocess
import sys

import pytest

from inspect_tool import errors
from inspect_tool.output import destination
from inspect_tool.cli import main

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]


def _snapshot(root):
  out = {}
  for directory, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(directory, name)
      out[os.path.relpath(path, root)] = None if os.path.isdir(path) else open(path, "rb").read()
  return out


def _steps_copy(tmp_path):
  """A copy of the reference checkpoint's directory of steps (`steps/0/items/...`)."""
  import shutil  # pylint: disable=import-outside-toplevel

  steps = tmp_path / "steps"
  shutil.copytree(CKPT, steps)
  return steps


def _export(capsys, *args):
  code = main(["export", *TOKENS, *args, "--no-validate"])
  captured = capsys.readouterr()
  return code, captured.out, captured.err


@pytest.mark.parametrize("case", ["source", "source_parent", "inside_steps", "sibling_step", "items_dir"])
def test_export_never_writes_over_or_into_its_source(tmp_path, capsys, case):
  steps = _steps_copy(tmp_path)
  (tmp_path / "neighbour.txt").write_text("keep me")
  source, dst = {"source": (steps, steps), "source_parent": (steps, tmp_path),
                 "inside_steps": (steps, steps / "1"), "sibling_step": (steps / "0", steps / "7"),
                 "items_dir": (steps / "0" / "items", steps / "0")}[case]
  before = _snapshot(tmp_path)
  code, out, err = _export(capsys, "--checkpoint", str(source), "--output", str(dst), "--overwrite")
  assert code == 2 and out == "" and len(err.splitlines()) == 1, err
  assert "source" in err and repr(str(dst)) in err
  assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("output", ["", ".", "..", "  "])
def test_export_never_replaces_the_working_directory(tmp_path, capsys, monkeypatch, output):
  work = tmp_path / "work"
  work.mkdir()
  (work / "notes.txt").write_text("mine")
  monkeypatch.chdir(work)
  before = _snapshot(tmp_path)
  code, out, err = _export(capsys, "--random-init", "--output", output, "--overwrite")
  assert code == 2 and out == "" and len(err.splitlines()) == 1, err
  assert ("working directory" in err) if output.strip() else ("output path is empty" in err)
  assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("kind", ["plain_dir", "file", "symlink"])
def test_overwrite_replaces_only_a_checkpoint(tmp_path, capsys, kind):
  dst = tmp_path / "dst"
  if kind == "plain_dir":
    dst.mkdir()
    (dst / "thesis.tex").write_text("years of work")
  elif kind == "file":
    dst.write_text("a file")
  else:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
    dst.symlink_to(target)
  before = _snapshot(tmp_path)
  code, _, err = _export(capsys, "--random-init", "--output", str(dst), "--overwrite")
  assert code == 2 and len(err.splitlines()) == 1, err
  assert {"plain_dir": "not a checkpoint", "file": "is a file", "symlink": "symbolic link"}[kind] in err
  assert _snapshot(tmp_path) == before


def test_replaceable_recognises_exports_and_orbax_checkpoints(tmp_path):
  assert destination.replaceable(CKPT) == "Orbax checkpoint"
  assert destination.replaceable(os.path.join(CKPT, "0")) == "Orbax checkpoint"
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"producer": "inspect_checkpoint"}}))
  assert destination.replaceable(str(hf)) == "inspect_checkpoint export"
  (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 1}}))  # someone's HF model
  assert destination.replaceable(str(hf)) is None


def test_second_claim_on_the_same_destination_fails_with_one_line(tmp_path):
  dst = str(tmp_path / "dst")
  with destination.claim(dst):
    code = ("import sys; from inspect_tool import errors; from inspect_tool.output import destination\n"
            "try:\n  destination.claim(sys.argv[1]).__enter__()\n"
            "except errors.InputError as e:\n  print(e); sys.exit(2)\n")
    out = subprocess.run([sys.executable, "-c", code, dst], capture_output=True, text=True, check=False)
    assert out.returncode == 2 and "being written by another inspect_checkpoint run" in out.stdout
  assert sorted(os.listdir(tmp_path)) == []  # the lock file goes with the claim
  with destination.claim(dst):
    pass


def _dead_pid():
  proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                        check=True)
  return int(proc.stdout)


def test_claim_reclaims_temporaries_of_dead_runs_and_nothing_else(tmp_path):
  dst = tmp_path / "dst"
  dead = _dead_pid()
  partial = tmp_path / f".dst.tmp-{dead}-abc123"
  partial.mkdir()
  (partial / destination.TMP_MARKER).write_text("1")
  (partial / "0").mkdir()
  live = tmp_path / f".dst.tmp-{os.getppid()}-abc123"  # a live process (our parent): not ours to touch
  live.mkdir()
  (live / destination.TMP_MARKER).write_text("1")
  foreign = tmp_path / f".dst.tmp-{dead}-zzz"  # right name, no marker, no checkpoint: a user's directory
  foreign.mkdir()
  (foreign / "notes.txt").write_text("mine")
  other = tmp_path / f".other.tmp-{dead}-abc"
  other.mkdir()
  (other / destination.TMP_MARKER).write_text("1")
  with destination.claim(str(dst)) as claimed:
    assert claimed.reclaimed == [str(partial)]
  assert sorted(os.listdir(tmp_path)) == sorted([live.name, foreign.name, other.name])


def test_claim_restores_a_previous_output_left_aside_by_a_killed_fallback_swap(tmp_path):
  dst = tmp_path / "dst"
  aside = tmp_path / f".dst.tmp-{_dead_pid()}-abc123.old"
  aside.mkdir()
  (aside / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  with pytest.raises(errors.InputError, match="already exists"):
    with destination.claim(str(dst)):
      pass
  assert sorted(os.listdir(tmp_path)) == ["dst"] and os.listdir(dst) == ["quantization_report.json"]


@pytest.mark.parametrize("option", ["--output_file", "--html"])
def test_listing_files_are_not_replaced_without_overwrite(tmp_path, capsys, option):
  path = tmp_path / "out"
  path.write_text("previous")
  code = main(["maxtext", "model_name=deepseek3-tiny", option, str(path)])
  err = capsys.readouterr().err
  assert code == 2 and "already exists; pass --overwrite" in err and len(err.splitlines()) == 1
  assert path.read_text() == "previous"
  assert main(["maxtext", "model_name=deepseek3-tiny", option, str(path), "--overwrite"]) == 0
  assert path.read_text() != "previous"


def test_save_logits_is_refused_before_the_run_without_overwrite(tmp_path, capsys):
  path = tmp_path / "logits.npz"
  path.write_bytes(b"previous")
  code = main(["forward", "model_name=deepseek3-671b", "--save-logits", str(path)])  # refused before building
  err = capsys.readouterr().err
  assert code == 2 and "already exists; pass --overwrite" in err and len(err.splitlines()) == 1
  assert path.read_bytes() == b"previous"
