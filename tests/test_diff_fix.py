"""`diff`'s fix: from the bare preset to agreement in one step. The printed `try:` command is run as printed and must
agree (exit 0) on MaxText's L4 checkpoint, MaxText's V3.2 and V4 small checkpoints, an unscanned DeepSeek-V2 checkpoint
and the transformers-saved directory; no preset ends in a traceback against a Hugging Face directory."""

import pathlib
import shlex

import pytest

import export_sources
import test_export_family
from inspect_tool.configuration import presets

from conftest import DATA as DATA_DIR
from conftest import run_cli
DATA = pathlib.Path(DATA_DIR)
HF = str(DATA / "import" / "hf_small")
DS2 = ["model_name=deepseek2-16b", "override_model_config=true", "scan_layers=false", "base_emb_dim=64",
       "base_num_query_heads=4", "base_num_kv_heads=4", "base_mlp_dim=128", "base_moe_mlp_dim=32",
       "base_num_decoder_layers=3", "first_num_dense_layers=1", "vocab_size=256", "num_experts=8",
       "num_experts_per_tok=2", "shared_experts=2", "kv_lora_rank=16", "qk_nope_head_dim=32", "qk_rope_head_dim=16",
       "v_head_dim=32"]



def _ds2(tmp: pathlib.Path) -> str:
  export_sources.write_source(str(tmp / "0"), DS2)
  return str(tmp / "0")


AXIS0 = ["model_name=deepseek3-tiny", "override_model_config=true", "param_scan_axis=0", "base_num_decoder_layers=5",
         "first_num_dense_layers=2", "vocab_size=256", "num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=48",
         "base_mlp_dim=96", "shared_experts=2", "mtp_num_layers=2", "q_lora_rank=0"]


def _axis0(tmp: pathlib.Path) -> str:
  export_sources.write_source(str(tmp / "0"), AXIS0)
  return str(tmp / "0")


CASES = {  # bare preset, checkpoint, keys the fix must set
    "L4": ("deepseek3-tiny", lambda tmp: str(DATA / "ckpt_deepseek3-tiny-L4-V1024"),
           ["vocab_size=1024", "first_num_dense_layers=1", "base_num_decoder_layers=4", "mtp_num_layers=1"]),
    "V3.2": ("deepseek3.2-671b", lambda tmp: str(DATA / "ckpt_v32-small"),
             ["base_emb_dim=64", "q_lora_rank=32", "kv_lora_rank=16", "qk_rope_head_dim=16", "qk_nope_head_dim=32",
              "v_head_dim=32", "indexer_n_heads=4", "indexer_head_dim=32", "num_experts=8", "base_moe_mlp_dim=32",
              "base_mlp_dim=128", "base_num_query_heads=4"]),
    "V4": ("deepseek4-tiny", test_export_family._v4_checkpoint, ["vocab_size=512"]),  # pylint: disable=protected-access
    "DS2 unscanned": ("deepseek2-16b", _ds2, [t for t in DS2[2:] if not t.startswith(  # the preset's own values,
        ("num_experts_per_tok", "shared_experts", "first_num_dense_layers"))]),      # or not in the shapes
    "layer axis 0, no q LoRA, 2 MTP layers, fewer experts than the preset's top-k": (
        "deepseek3-tiny", _axis0, AXIS0[2:7] + AXIS0[8:] + ["num_experts_per_tok=4"]),
    "transformers": ("deepseek3-tiny", lambda tmp: HF, ["routed_scaling_factor=1.5", "n_routing_groups=2",
                                                        "rope_factor=4.0", "mscale=1.0"]),
}


@pytest.mark.parametrize("preset, make, expected", CASES.values(), ids=CASES.keys())
def test_the_printed_fix_agrees_in_one_step(tmp_path, capsys, preset, make, expected):
  path = make(tmp_path)
  code, out, err = run_cli(capsys, "diff", f"model_name={preset}", "--path", path)
  assert code == 1, err
  fix = out.rstrip().splitlines()[-1]
  assert fix.startswith(f"try: inspect_checkpoint diff model_name={preset} override_model_config=true "), fix
  argv = shlex.split(fix[len("try: "):])
  assert argv[-2:] == ["--path", path]
  assert set(expected) <= set(argv), set(expected) - set(argv)
  code, out, err = run_cli(capsys, *argv[1:])
  assert code == 0 and "AGREE" in out, out + err


@pytest.mark.parametrize("preset", presets.names())
def test_no_preset_ends_in_a_traceback_against_a_hugging_face_directory(capsys, preset):
  code, out, err = run_cli(capsys, "diff", f"model_name={preset}", "--path", HF)
  assert code in (1, 2), out + err
  if code == 2:
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ")
  else:
    assert out.splitlines()[-1].startswith("try: inspect_checkpoint diff model_name=")


def test_forward_names_the_mtp_arrays_a_model_without_mtp_does_not_use(capsys):
  l4 = ["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024", "mtp_num_layers=0"]
  code, out, err = run_cli(capsys, "forward", *l4, "--checkpoint", DATA / "ckpt_deepseek3-tiny-L4-V1024")
  assert code == 0, err
  (note,) = [line for line in err.splitlines() if line.startswith("note:")]
  assert " holds 21 array(s) the model does not use: params.params.mtp_block.mtp_layer_1." in note
