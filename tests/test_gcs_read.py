"""Reading gs:// checkpoints from the local GCS emulator (tests/gcs_emulator.py): MaxText's L4 checkpoint uploaded as
MaxText keeps them (gs://bucket/run/checkpoints/<step>/items) lists and diffs as its local copy does, and `forward`
reproduces MaxText's golden logits from it bit for bit, as tests/test_model_forward.py does locally. Bad remote input
(no bucket, refused, unreachable, not a checkpoint) is one line on stderr naming the path, exit 2."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from gcs_emulator import BUCKET
from conftest import run_cli

from conftest import DATA as DATA_DIR
from conftest import REPO
ROOT = pathlib.Path(REPO)
DATA = pathlib.Path(DATA_DIR)
CKPT = str(DATA / "ckpt_deepseek3-tiny-L4-V1024")
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
RUN = f"gs://{BUCKET}/read/run/checkpoints"


@pytest.fixture(scope="module")
def remote(gcs):
  gcs.upload(CKPT, RUN)
  return RUN



def _tool_lines(err: str) -> list[str]:
  """stderr without tensorstore's own INFO log line about the emulator's test token (not the tool's output)."""
  return [l for l in err.splitlines() if "GOOGLE_AUTH_TOKEN_FOR_TESTING" not in l]


@pytest.mark.parametrize("extra", [[], ["--all"], ["--summary"], ["--format", "json"]])
def test_orbax_listing_of_a_directory_of_steps_is_the_local_listing(remote, capsys, extra):
  local = run_cli(capsys, "orbax", "--path", CKPT, *extra)
  there = run_cli(capsys, "orbax", "--path", remote, *extra)
  assert local[0] == there[0] == 0, there[2]
  assert there[1].replace(remote, CKPT) == local[1]
  assert _tool_lines(there[2]) == _tool_lines(local[2]) == ["using step 0"], there[2]


@pytest.mark.parametrize("suffix", ["/0", "/0/items", "/0/items/", "//0/./items"])
def test_step_and_items_paths_resolve_as_locally(remote, capsys, suffix):
  code, out, _ = run_cli(capsys, "orbax", "--path", remote + suffix, "--format", "json")
  assert code == 0
  local = run_cli(capsys, "orbax", "--path", CKPT + suffix, "--format", "json")[1]
  assert out.replace(remote, CKPT) == local


def test_diff_agrees_as_locally(remote, capsys):
  local = run_cli(capsys, "diff", *L4, "--path", CKPT)
  there = run_cli(capsys, "diff", *L4, "--path", remote)
  assert local[0] == there[0] == 0
  assert there[1].replace(remote, CKPT) == local[1]
  assert "AGREE" in there[1]
  changed = run_cli(capsys, "diff", *L4[:-1], "vocab_size=2048", "--path", remote)
  assert changed[0] == 1 and changed[1].replace(remote, CKPT) == run_cli(
      capsys, "diff", *L4[:-1], "vocab_size=2048", "--path", CKPT)[1]


def test_forward_from_gcs_reproduces_maxtext_golden_logits(remote, capsys, tmp_path):
  golden = dict(np.load(DATA / "golden" / "a_noquant.npz"))
  np.save(tmp_path / "tokens.npy", golden["tokens"])
  np.save(tmp_path / "targets.npy", golden["targets"])
  code, out, err = run_cli(capsys, "forward", *L4, "--checkpoint", remote, "--tokens", tmp_path / "tokens.npy",
                        "--targets", tmp_path / "targets.npy", "--save-logits", tmp_path / "logits.npz")
  assert code == 0, err
  assert f"weights: Orbax checkpoint {remote}/0/items (step 0)" in out.splitlines()
  saved = np.load(tmp_path / "logits.npz")
  np.testing.assert_array_equal(saved["logits"], golden["logits"])  # bit for bit, as test_model_forward locally
  np.testing.assert_array_equal(saved["mtp_logits"].reshape(golden["mtp_logits"].shape), golden["mtp_logits"])


# Bad remote input: one line, exit 2, the path named ------------------------------------------------------------------


def _cli_process(env: dict, *argv) -> subprocess.CompletedProcess:
  """The tool in a fresh process (no cached listings), with `env` over os.environ."""
  return subprocess.run([sys.executable, "-m", "inspect_tool", *map(str, argv)], capture_output=True, text=True,
                        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, timeout=300, check=False)


def _one_line(result) -> str:
  """The tool's one stderr line. tensorstore 0.1.86 logs one INFO line of its own (google_auth_provider.cc) when it
  first authenticates, with no switch to quiet it: that line is left out here."""
  assert result.returncode == 2, result.stderr
  assert result.stdout == ""
  err = "".join(l for l in result.stderr.splitlines(keepends=True) if "google_auth_provider.cc" not in l)
  assert err.count("\n") == 1 and "Traceback" not in err, result.stderr
  return err


def test_missing_bucket_is_named(remote):
  err = _one_line(_cli_process({}, "orbax", "--path", "gs://no-such-bucket-here/run/checkpoints"))
  assert err == "error: gs://no-such-bucket-here/run/checkpoints: no such bucket gs://no-such-bucket-here\n"
  err = _one_line(_cli_process({}, "orbax", "--path", "gs:///run"))  # gcsfs would answer HTTP 501 and a traceback
  assert err == "error: gs:///run: names no bucket; accepted: gs://BUCKET/PATH\n"


def test_missing_prefix_reads_as_a_missing_local_path(remote):
  err = _one_line(_cli_process({}, "diff", *L4, "--path", f"gs://{BUCKET}/read/run/nothing"))
  assert err == f"error: checkpoint path does not exist: gs://{BUCKET}/read/run/nothing\n"


def test_a_prefix_that_is_not_a_checkpoint_is_refused_in_the_local_wording(gcs, tmp_path):
  (tmp_path / "notes.txt").write_text("not a checkpoint")
  (tmp_path / "logs").mkdir()
  (tmp_path / "logs" / "a.log").write_text("x")
  url = gcs.upload(tmp_path, f"gs://{BUCKET}/read/not-a-checkpoint")
  for command in (["orbax", "--path"], ["forward", *L4, "--checkpoint"]):
    err = _one_line(_cli_process({}, *command, url))
    assert err.startswith(f"error: not an Orbax checkpoint: {url}; expected an Orbax step directory")
  local = _one_line(_cli_process({}, "hf", "--path", tmp_path))
  assert _one_line(_cli_process({}, "hf", "--path", url)) == local.replace(str(tmp_path), url)


def test_a_bad_time_limit_is_one_line(remote):
  err = _one_line(_cli_process({"INSPECT_GCS_TIMEOUT": "soon"}, "orbax", "--path", remote))
  assert err == "error: INSPECT_GCS_TIMEOUT='soon' is not a number of seconds; accepted: a positive number\n"


def test_refused_access_is_permission_denied(gcs, remote):
  denied = "denied-bucket"
  gcs.create_bucket(denied)
  gcs.upload(CKPT, f"gs://{denied}/run")
  with gcs.refusing(denied):  # the emulator's test-side proxy answers 403 for that bucket (tests/gcs_emulator.py)
    err = _one_line(_cli_process({}, "orbax", "--path", f"gs://{denied}/run"))
    assert err.startswith(f"error: gs://{denied}/run: permission denied by Cloud Storage (")
    allowed = _cli_process({}, "orbax", "--path", remote, "--summary")
  assert allowed.returncode == 0, allowed.stderr  # one bucket refused only


def test_unreachable_storage_gives_up_in_bounded_time():
  closed, sock = _closed_port_url()
  with sock:
    env = {"STORAGE_EMULATOR_HOST": closed, "TENSORSTORE_GCS_HTTP_URL": closed, "INSPECT_GCS_TIMEOUT": "3"}
    err = _one_line(_cli_process(env, "orbax", "--path", f"gs://{BUCKET}/read/run/checkpoints"))
  assert err == (f"error: gs://{BUCKET}/read/run/checkpoints: Cloud Storage at {closed} did not answer; gave up "
                 "after 3 s (INSPECT_GCS_TIMEOUT sets the limit)\n")


def _closed_port_url() -> tuple[str, socket.socket]:
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
  return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


def test_array_store_unreachable_gives_up_after_bounded_tries(remote):
  """Metadata through gcsfs answers, tensorstore's endpoint does not: its retries are bounded (storage.remote)."""
  closed, sock = _closed_port_url()
  with sock:
    err = _one_line(_cli_process({"TENSORSTORE_GCS_HTTP_URL": closed}, "orbax", "--path", remote))
  assert err.startswith(f"error: {remote}/0/items: cannot reach Cloud Storage at {closed}; gave up after 4 tries (")


@pytest.mark.parametrize("command", [["hf", "--path"], ["forward", *L4, "--checkpoint"], ["import", "--output",
                                                                                            "/nonexistent/x", "--path"]])
def test_every_reading_command_names_a_missing_bucket(command):
  err = _one_line(_cli_process({}, *command, "gs://no-such-bucket-here/ckpt"))
  assert err.startswith("error: gs://no-such-bucket-here/ckpt")  # import names the config.json it reads first
  assert err.endswith(": no such bucket gs://no-such-bucket-here\n")
