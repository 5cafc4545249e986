"""No silent guesses: `export` refuses to export a random init unless asked, `forward` and `export` say which weights
they ran, and `forward --compare` on random weights warns that its figures say nothing about a trained model."""

import json
import os

from inspect_tool import cli

from conftest import DATA
CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")  # MaxText's own checkpoint: one step, 0
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
WARNING = ("warning: --compare on random-init weights (seed {seed}): these figures compare the quantized and "
           "unquantized random model and say nothing about a trained model; pass --checkpoint for that")


def run(capsys, *argv):
  code = cli.main(list(argv))
  out, err = capsys.readouterr()
  return code, out, err


def test_export_without_checkpoint_is_refused_in_one_line(capsys, tmp_path):
  dst = tmp_path / "out"
  code, out, err = run(capsys, "export", *L4, "quantization=fp8_full", "--output", str(dst))
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err
  assert "--checkpoint" in err and "accepted without one: --random-init" in err
  assert os.listdir(tmp_path) == []
  code, out, err = run(capsys, "export", *L4, "quantization=fp8_full", "--output", str(dst), "--checkpoint", CKPT,
                       "--random-init")
  assert code == 2 and out == "" and "exclude each other" in err and len(err.strip().splitlines()) == 1
  assert os.listdir(tmp_path) == []


def test_export_of_a_checkpoint_names_it_and_its_step(capsys, tmp_path):
  dst = tmp_path / "out"
  code, out, err = run(capsys, "export", *L4, "quantization=fp8_full", "--checkpoint", CKPT, "--output", str(dst),
                       "--no-validate")
  assert code == 0, err
  items = os.path.join(CKPT, "0", "items")  # the one step of the directory of steps
  assert out.splitlines()[0] == f"weights: Orbax checkpoint {items} (step 0)"


def test_forward_on_random_weights_says_so_and_compare_warns(capsys):
  code, out, err = run(capsys, "forward", *L4, "init_weights_seed=7", "quantization=fp8_full", "--compare")
  assert code == 0, err
  assert out.splitlines()[1] == "weights: random init, seed 7"
  assert WARNING.format(seed=7) in err.splitlines()
  assert "unquantized (reference) vs quantized" in out


def test_forward_of_a_checkpoint_names_it_and_does_not_warn(capsys):
  code, out, err = run(capsys, "forward", *L4, "quantization=fp8_full", "--checkpoint", os.path.join(CKPT, "0"),
                       "--compare", "--format", "json")
  assert code == 0, err
  assert json.loads(out)["weights"] == f"Orbax checkpoint {os.path.join(CKPT, '0', 'items')} (step 0)"
  assert "warning" not in err
