"""Each refusal names the key the user gave (issue 18, item 8): not a derived value, another option or a later
check that the bad key happens to trip. Exit 2, one line."""

import os

import pytest

from hostile import refused
from conftest import DATA

TINY = ["maxtext", "model_name=deepseek3-tiny"]
V4 = ["maxtext", "model_name=deepseek4-284b", "override_model_config=true"]  # 43 layers, 43 compress_ratios
EXPORT = ["export", "model_name=deepseek3-tiny", "quantization=fp8_full", "--random-init", "--output", "never"]


@pytest.mark.parametrize("argv, line", [
    # num_slices=0 used to be reported as "--devices 0" (topology × slices) or "not divisible by num_slices=0"
    ([*TINY, "num_slices=0", "--topology", "v5p-8"], "num_slices=0: the slice count must be a positive integer, or "
     "-1 (MaxText's default: compile_topology_num_slices, else 1)"),
    ([*TINY, "num_slices=0", "--devices", "8"], "num_slices=0: the slice count"),
    ([*TINY, "num_slices=-2", "--devices", "8"], "num_slices=-2: the slice count"),
    # parallelism keys, not the mesh axes behind them ("ICI parallelism fsdp=3", "the -1 axis (fsdp)")
    ([*TINY, "ici_fsdp_parallelism=0", "--devices", "8"], "ici_fsdp_parallelism=0: a parallelism must be a "
     "positive integer, or -1 for the devices per slice the others leave"),
    ([*TINY, "ici_tensor_parallelism=0", "--devices", "8"], "ici_tensor_parallelism=0: a parallelism must be"),
    ([*TINY, "ici_fsdp_parallelism=-2", "--devices", "8"], "ici_fsdp_parallelism=-2: a parallelism must be"),
    ([*TINY, "ici_fsdp_parallelism=3", "--devices", "8"], "ici_fsdp_parallelism=3 does not match the 8 devices per "
     "slice; make the ici_* values multiply to it (or set one to -1)"),
    ([*TINY, "ici_tensor_parallelism=-1", "--devices", "8"], "only one axis may be -1 (auto), got -1 for "
     "ici_fsdp_parallelism, ici_tensor_parallelism"),
    ([*TINY, "ici_fsdp_parallelism=-1", "ici_tensor_parallelism=3", "--devices", "8"], "ici_fsdp_parallelism=-1 "
     "cannot be resolved: the 8 devices per slice are not a multiple of ici_tensor_parallelism=3 = 3"),
    ([*TINY, "num_slices=2", "ici_fsdp_parallelism=4", "dcn_data_parallelism=3", "--devices", "8"],
     "dcn_data_parallelism=3 does not match the 2 slices; make the dcn_* values multiply to it"),
    ([*TINY, "num_slices=2", "--topology", "v5p-8", "--devices", "4"], "--devices 4 disagrees with --topology v5p-8 "
     "(4 devices per slice × num_slices=2 = 8)"),
    # first_num_hash_layers beyond the layers, not "compress_ratios has 43 entries; 44 layers need one each"
    ([*V4, "first_num_hash_layers=44"], "first_num_hash_layers=44 must be within 0..43 (the decoder layers, "
     "base_num_decoder_layers=43)"),
    ([*V4, "first_num_hash_layers=44", "scan_layers=false"], "first_num_hash_layers=44 must be within 0..43"),
    ([*V4, "compress_ratios=[0,0,4]", "scan_layers=false"], "compress_ratios has 3 entries; "
     "base_num_decoder_layers=43 needs 43, one per layer"),
    ([*V4, "compress_ratios=[0,0]"], "compress_ratios has 2 entries; first_num_hash_layers=3 with scan_layers=true "
     "needs 3"),
    ([*TINY, "override_model_config=true", "base_num_decoder_layers=2"], "first_num_dense_layers=3 exceeds the 2 "
     "decoder layers (base_num_decoder_layers=2)"),
    ([*V4, "base_num_decoder_layers=0"], "base_num_decoder_layers=0 must be a positive integer"),  # not first_num_hash
    ([*TINY, "mesh_axes=[]", "--devices", "8"], "mesh_axes=[] names no axis"),  # was "all ici_* 1 does not match"
    ([*TINY, "override_model_config=true", f"base_moe_mlp_dim={2**62}"], "the model's routed experts would hold "
     "2.88e+23 elements (>= 2^62; base_num_decoder_layers × num_experts × base_emb_dim × base_moe_mlp_dim)"),
    ([*TINY, "opt_type=bogus", "--devices", "8"], "opt_type='bogus': per-device memory is modelled for adamw, "
     "adam_pax, sgd"),  # was "optimizer 'bogus'"
    # --num-processes 0 was "--process-id 0 is not in [0, 0)"
    ([*EXPORT, "--coordinator", "h:1", "--num-processes", "0", "--process-id", "0"],
     "Invalid value for '--num-processes' / '--num_processes': 0 is not in the range x>=1."),
    ([*EXPORT, "--coordinator", "h:1", "--num-processes", "2", "--process-id", "-1"],
     "Invalid value for '--process-id' / '--process_id': -1 is not in the range x>=0."),
])
def test_the_line_names_the_key_given(capsys, argv, line):
  got = refused(capsys, argv, line)
  assert got.startswith("error: ") and not os.path.exists("never")


def _model_file(path, layers=4):
  path.write_text(f"base_emb_dim: 64\nbase_num_decoder_layers: {layers}\n")
  return str(path)


def test_a_second_model_file_that_is_missing_is_named(capsys, tmp_path):
  a = _model_file(tmp_path / "a.yml")
  missing = str(tmp_path / "missing.yml")
  got = refused(capsys, ["maxtext", a, missing], repr(missing))
  assert repr(a) not in got
  refused(capsys, ["maxtext", missing, a], repr(missing))
  refused(capsys, ["maxtext", a, f"model_file={missing}"], repr(missing))


@pytest.mark.parametrize("second", ["bare", "model_file="])
def test_two_model_files_are_refused(capsys, tmp_path, second):
  a, b = _model_file(tmp_path / "a.yml"), _model_file(tmp_path / "b.yaml", layers=8)
  refused(capsys, ["maxtext", a, b if second == "bare" else f"model_file={b}"],
          f"2 model files given ({a!r}, {b!r}); a model is read from one: give one model file")


@pytest.mark.parametrize("text, line", [
    ("base_emb_dim: 64\nfoo_bar: 3\n", "unknown config key 'foo_bar'"),
    ("base_emb_dim: abc\n", "base_emb_dim='abc' is not an integer"),
])
def test_a_bad_key_in_a_model_file_names_the_file(capsys, tmp_path, text, line):
  path = tmp_path / "m.yml"
  path.write_text(text)
  for argv in (["maxtext", str(path)], ["maxtext", f"model_file={path}"]):
    refused(capsys, argv, f"error: model file {str(path)!r}: {line}")


def test_one_model_file_still_works(capsys, tmp_path):
  from inspect_tool.cli import main  # pylint: disable=import-outside-toplevel

  assert main(["maxtext", _model_file(tmp_path / "a.yml")]) == 0
  assert "key: params.params.decoder.decoder_norm.scale | shape: (64,)\n" in capsys.readouterr().out


@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
def test_export_names_the_mtp_arrays_a_model_without_mtp_does_not_use(capsys, tmp_path, layout):
  """The checkpoint's MTP layer (21 arrays) is dropped by a model with mtp_num_layers=0: said, not silent."""
  from inspect_tool.cli import main  # pylint: disable=import-outside-toplevel

  l4 = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024", "mtp_num_layers=0", "quantization=fp8_full"]
  ckpt = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
  code = main(["export", *l4, "--checkpoint", ckpt, "--output", str(tmp_path / "dst"), "--layout", layout,
               "--no-validate"])
  err = capsys.readouterr().err
  assert code == 0, err
  (note,) = [line for line in err.splitlines() if line.startswith("note:")]
  assert " holds 21 array(s) the model does not use: params.params.mtp_block.mtp_layer_1." in note
