"""A Hugging Face directory on gs:// (tests/data/import/hf_small in the local GCS emulator, tests/gcs_emulator.py):
headers list as the local copy's do, its keys are derived from its config.json, `forward` reproduces transformers'
logits (tests/data/import/hf_small_transformers_logits.npz) within the bound of tests/test_hf_keys.py, and `import`
writes MaxText's own converter's arrays (tests/data/import/maxtext_converted) as tests/test_import.py checks."""

import os

import numpy as np
import pytest

from gcs_emulator import BUCKET
from test_export_distributed import _arrays
from test_hf_keys import KEYS, _rel

from conftest import DATA as DATA_DIR
from conftest import run_cli
DATA = os.path.join(DATA_DIR, "import")
HF = os.path.join(DATA, "hf_small")


@pytest.fixture(scope="module")
def remote(gcs):
  return gcs.upload(HF, f"gs://{BUCKET}/read/hf_small")



@pytest.mark.parametrize("extra", [[], ["--summary"], ["--format", "json"], ["--keys"]])
def test_hf_listing_and_keys_are_the_local_ones(remote, capsys, extra):
  local = run_cli(capsys, "hf", "--path", HF, *extra)
  there = run_cli(capsys, "hf", "--path", remote, *extra)
  assert local[0] == there[0] == 0, there[2]
  assert there[1].replace(remote, HF) == local[1]
  if extra == ["--keys"]:
    assert there[1] == KEYS + "\n"


def test_one_shard_and_the_index_list_as_locally(remote, capsys):
  for name in ("model-00002-of-00002.safetensors", "model.safetensors.index.json"):
    local = run_cli(capsys, "hf", "--path", os.path.join(HF, name), "--format", "json")
    there = run_cli(capsys, "hf", "--path", f"{remote}/{name}", "--format", "json")
    assert local[0] == there[0] == 0, there[2]
    assert there[1].replace(remote, HF) == local[1]


def test_forward_from_gcs_equals_transformers(remote, capsys, tmp_path):
  reference = np.load(os.path.join(DATA, "hf_small_transformers_logits.npz"))["logits"]
  code, out, err = run_cli(capsys, "forward", *KEYS.split(), "dtype=float32", "--checkpoint", remote,
                        "--tokens", os.path.join(DATA, "tokens.npy"), "--save-logits", tmp_path / "logits.npz")
  assert code == 0, err
  assert f"weights: Hugging Face directory {remote}" in out.splitlines()
  logits = np.load(tmp_path / "logits.npz")["logits"]
  assert _rel(logits, reference) <= 1e-5  # as the local test (measured 3.8e-7)
  assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_diff_of_the_derived_keys_agrees(remote, capsys):
  code, out, err = run_cli(capsys, "diff", *KEYS.split(), "--path", remote)
  assert code == 0, err
  assert "AGREE" in out


def test_import_from_gcs_writes_maxtexts_converter_arrays(remote, capsys, tmp_path):
  code, _, err = run_cli(capsys, "import", "--path", remote, "--output", tmp_path / "imported")
  assert code == 0, err
  ours, theirs = _arrays(str(tmp_path / "imported")), _arrays(os.path.join(DATA, "maxtext_converted"))
  assert sorted(ours) == sorted(theirs) and len(ours) == 54
  ours.pop("step"), theirs.pop("step")
  for name, value in ours.items():
    assert np.array_equal(value.astype(np.float16), theirs[name]), name  # MaxText's converter stores float16
