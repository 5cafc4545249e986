"""`export` and `import` with `--output gs://...`, against the local GCS emulator (the `gcs` fixture): the published
checkpoint reproduces MaxText's fp8_full golden logits, two processes publish what one does byte for byte, an import
and a deepseek-fp8 export equal the local ones, Orbax accepts the step as committed, and the single-file outputs
refuse gs://.
Every process writes its share straight under the staging prefix: the two processes have separate TMPDIRs."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from gcs_emulator import BUCKET
from inspect_tool import cli
from inspect_tool.storage import commit
from inspect_tool.storage import objects
from test_export import CKPT, TINY, _assert_reproduces_fp8_golden, _tokens
from test_export_distributed import _arrays, _run_processes
from test_import import HF

from conftest import REPO


def _cli(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def _assert_same_arrays(a: dict, b: dict, count: int | None = None) -> None:
  assert sorted(a) == sorted(b) and (count is None or len(a) == count)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


def _shape(names) -> list[str]:
  """Object names with OCDBT's data files (`d/<hex>`, random names, how many varies between runs) as one."""
  return sorted({re.sub(r"/d/[0-9a-f]+$", "/d/*", n) for n in names})


def test_an_export_to_gs_reproduces_maxtexts_fp8_golden(gcs, capsys, tmp_path):
  dst = f"gs://{BUCKET}/golden/fp8"
  code, out, err = _cli(capsys, "export", *_tokens(True), "--checkpoint", CKPT, "--output", dst)
  assert code == 0, err
  assert f"\nwrote {dst}\n" in out
  names = gcs.listing(dst)
  assert names[-3:] == ["commit_success.txt", "export_manifest.json", "quantization_report.json"]
  assert "0/commit_success.txt" in names
  assert commit.committed(dst) and commit.committed(dst + "/0/items")
  assert gcs.listing(f"gs://{BUCKET}/golden") == [f"fp8/{n}" for n in names]  # no staging prefix, no lock left
  # The published objects, read from the bucket by `forward`, reproduce MaxText's fp8_full golden.
  logits = tmp_path / "logits.npz"
  code, out, err = _cli(capsys, "forward", *_tokens(True), "--checkpoint", dst, "--save-logits", str(logits))
  assert code == 0, err
  assert f"weights: FP8 export {dst}" in out
  saved = np.load(logits)
  _assert_reproduces_fp8_golden(saved["logits"], saved["mtp_logits"][0], quantize_mtp=True)
  # Orbax itself takes the step as a finalized checkpoint (its commit marker on object stores).
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  assert ocp.step.is_checkpoint_finalized(epath.Path(dst) / "0")
  report = json.loads(objects.read(dst + "/quantization_report.json")[0])
  assert report["validation"]["passed"] is True


@pytest.mark.slow  # stress: a multi-process job (.ci/run: once, on the primary stack)
def test_two_processes_export_to_gs_what_one_process_exports(gcs, tmp_path):
  one, two = f"gs://{BUCKET}/dist/one", f"gs://{BUCKET}/dist/two"
  single = subprocess.run([sys.executable, "-m", "inspect_tool", "export", *_tokens(True), "--checkpoint", CKPT,
                           "--output", one, "--no-validate", "--quiet"], capture_output=True, text=True, cwd=REPO,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), check=False, timeout=300)
  assert single.returncode == 0, single.stderr[-2000:]
  tmpdirs = [tmp_path / "tmp0", tmp_path / "tmp1"]  # no shared file system: each process its own TMPDIR
  for path in tmpdirs:
    path.mkdir()
  outs = _run_processes(["export", *_tokens(True), "--checkpoint", CKPT, "--output", two, "--no-validate"],
                        timeout=300, envs=[{"TMPDIR": str(path)} for path in tmpdirs])
  for code, _, err in outs:
    assert code == 0, err[-3000:]
  arrays = _arrays(two)
  _assert_same_arrays(_arrays(one), arrays, count=86)
  manifest = json.loads(objects.read(two + "/export_manifest.json")[0])  # hashed as written, nothing read back
  assert {e["name"]: e["sha256"] for e in manifest["tensors"]} == {
      name: hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest() for name, value in arrays.items()}
  listed = gcs.listing(two)
  assert {"0/items/ocdbt.process_0/manifest.ocdbt", "0/items/ocdbt.process_1/manifest.ocdbt"} <= set(listed)
  assert listed[-3:] == ["commit_success.txt", "export_manifest.json", "quantization_report.json"]
  assert gcs.listing(f"gs://{BUCKET}/dist") == sorted([f"one/{n}" for n in gcs.listing(one)]
                                                      + [f"two/{n}" for n in listed])
  assert [os.listdir(path) for path in tmpdirs] == [[], []]  # nothing written locally


def test_an_import_to_gs_equals_the_local_import(gcs, capsys, tmp_path):
  local, remote = str(tmp_path / "local"), f"gs://{BUCKET}/import/ckpt"
  for dst in (local, remote):
    code, _, err = _cli(capsys, "import", "--path", HF, "--output", dst)
    assert code == 0, err
  _assert_same_arrays(_arrays(local), _arrays(remote))
  local_names = [os.path.relpath(os.path.join(d, f), local) for d, _, fs in os.walk(local) for f in fs]
  markers = ["0/commit_success.txt", "0/items/commit_success.txt", "commit_success.txt"]  # Orbax's, then ours
  assert _shape(gcs.listing(remote)) == _shape(local_names + markers)
  assert json.loads(objects.read(remote + "/import_report.json")[0])["maxtext_keys"] == json.loads(
      open(os.path.join(local, "import_report.json"), encoding="utf-8").read())["maxtext_keys"]


def test_a_deepseek_fp8_export_to_gs_equals_the_local_one(gcs, capsys, tmp_path):
  local, remote = tmp_path / "local", f"gs://{BUCKET}/hf/fp8"
  for dst in (str(local), remote):
    code, out, err = _cli(capsys, "export", *TINY, "--checkpoint", CKPT, "--output", dst, "--layout",
                          "deepseek-fp8", "--no-validate")
    assert code == 0, err
  assert f"\nwrote {remote}: " in out
  listed = gcs.listing(remote)
  assert listed == sorted(os.listdir(local) + ["commit_success.txt"])
  for name in os.listdir(local):
    if name.endswith((".safetensors", "config.json", ".index.json")):
      assert objects.read(f"{remote}/{name}")[0] == (local / name).read_bytes(), name


@pytest.mark.parametrize("flag", ["--output_file", "--html"])
def test_single_file_outputs_refuse_gs_in_one_line(flag, capsys):
  code, out, err = _cli(capsys, "orbax", "--path", CKPT, flag, f"gs://{BUCKET}/report.txt")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert "is on object storage" in err and "give a local path" in err


def test_save_logits_refuses_gs_before_any_work(capsys):
  code, out, err = _cli(capsys, "forward", *TINY, "--checkpoint", CKPT, "--save-logits",
                        f"gs://{BUCKET}/logits.npz")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--save-logits" in err
