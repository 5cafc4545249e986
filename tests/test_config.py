"""Config resolution: presets, typed key=value parsing, MaxText's override and validation rules."""

import pytest

from inspect_tool import config, errors


def test_preset_sizes_and_derived_values():
  cfg = config.resolve_config(["model_name=deepseek3-671b", "mtp_num_layers=1"])
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.num_decoder_layers, cfg.num_moe_layers) == (7168, 128, 61, 58)
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.q_lora_rank, cfg.vocab_size) == (256, 8, 1536, 129280)
  assert cfg.deepseek_routing and cfg.mtp_num_layers == 1
  assert cfg.softmax_scale == pytest.approx(0.1352338, abs=1e-7)


def test_deepseek2_is_not_deepseek_routing_and_has_its_own_softmax_scale():
  cfg = config.resolve_config(["model_name=deepseek2-16b"])
  assert not cfg.deepseek_routing and cfg.q_lora_rank == 0 and not cfg.routed_bias
  assert cfg.softmax_scale == pytest.approx(0.1147214, abs=1e-7)


@pytest.mark.parametrize("text,expected", [("true", True), ("True", True), ("1", True), ("false", False),
                                           ("False", False), ("0", False)])
def test_bool_spellings(text, expected):
  assert config.resolve_config(["model_name=default", f"scan_layers={text}"]).scan_layers is expected


def test_typed_values_ints_floats_lists():
  cfg = config.resolve_config(["model_name=default", "mtp_loss_scaling_factor=0.25", "max_target_length=1_024",
                               "mlp_activations=[silu,linear]", "weight_sparsity_n=2", "weight_sparsity_m=4"])
  assert cfg.mtp_loss_scaling_factor == 0.25 and cfg.max_target_length == 1024
  assert cfg.mlp_activations == ("silu", "linear") and (cfg.weight_sparsity_n, cfg.weight_sparsity_m) == (2, 4)


def test_model_keys_need_override_model_config():
  with pytest.raises(errors.ConfigError, match="override_model_config=true"):
    config.resolve_config(["model_name=deepseek3-tiny", "base_num_decoder_layers=4"])
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "override_model_config=true", "base_num_decoder_layers=4"])
  assert cfg.num_decoder_layers == 4
  # The same value as the model file is not a conflict.
  assert config.resolve_config(["model_name=deepseek3-tiny", "base_emb_dim=64"]).emb_dim == 64


def test_global_parameter_scale_scales_sizes():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "global_parameter_scale=8"])
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.moe_mlp_dim, cfg.num_decoder_layers) == (128, 8, 128, 122)


@pytest.mark.parametrize("tokens,message", [
    (["model_name=nope"], "unknown model_name 'nope'; known: deepseek2-16b"),
    (["mtp_num_layer=1"], "did you mean 'mtp_num_layers'"),
    (["scan_layers=maybe"], "scan_layers='maybe' is not a boolean"),
    (["mtp_num_layers=one"], "mtp_num_layers='one' is not an integer"),
    (["model_name"], "not of the form key=value"),
    (["=3"], "not of the form key=value"),
    (["vocab_size=-1"], "vocab_size=-1 must be a positive integer"),
    (["mtp_num_layers=-2"], "mtp_num_layers=-2 must be >= 0"),
    (["enable_nnx=false"], "enable_nnx=false is not supported"),
    (["quantize_mtp=true", "quantization=fp8_full"], "needs mtp_num_layers > 0"),
    (["quantize_mtp=true", "mtp_num_layers=1", "quantization=int8"], "needs quantization=fp8_full"),
    (["quantization=fp9"], "quantization='fp9'; accepted:"),
    (["quantize_logits_proj=true", "quantization=fp8"], "quantize_logits_proj=true needs quantization=fp8_full"),
    (["quantization=fp8_full", "float32_gate_logits=true"], "quantize_router_proj"),
])
def test_bad_input_is_one_clear_line(tokens, message):
  with pytest.raises(errors.ConfigError) as info:
    config.resolve_config(["model_name=default"] + tokens)
  assert message in str(info.value) and "\n" not in str(info.value)


def test_a_model_must_be_named():
  with pytest.raises(errors.ConfigError, match="no model given: pass model_name=<one of deepseek2-16b"):
    config.resolve_config(["mtp_num_layers=1"])
  assert config.resolve_config(["model_name=default"]).model_name == "default"


def test_enable_nnx_true_and_maxtext_run_keys_are_accepted():
  cfg = config.resolve_config(["model_name=deepseek3-tiny", "enable_nnx=true", "run_name=x", "attention=dot_product",
                               "skip_jax_distributed_system=true"])
  assert cfg.enable_nnx


def test_user_model_file(tmp_path):
  path = tmp_path / "mini.yml"
  path.write_text("base_emb_dim: 32\nbase_num_query_heads: 2\nbase_num_kv_heads: 2\nnum_experts: 4\n"
                  "num_experts_per_tok: 2\nrouted_score_func: sigmoid\nbase_num_decoder_layers: 3\n"
                  "first_num_dense_layers: 1\nq_lora_rank: 8\nkv_lora_rank: 8\nvocab_size: 100\n")
  cfg = config.resolve_config([f"model_file={path}", "mtp_num_layers=1"])
  assert cfg.model_name == "mini" and cfg.emb_dim == 32 and cfg.num_moe_layers == 2
  with pytest.raises(errors.ConfigError, match="override_model_config"):
    config.resolve_config([str(path), "num_experts=8"])


def test_bad_model_file(tmp_path):
  path = tmp_path / "bad.yml"
  path.write_text("base_emb_dim: [1, 2\n")
  with pytest.raises(errors.ConfigError, match="not valid YAML"):
    config.resolve_config([f"model_file={path}"])
  path.write_text("emb_dimm: 3\n")
  with pytest.raises(errors.UnknownKeyError, match="emb_dimm"):
    config.resolve_config([f"model_file={path}"])
  with pytest.raises(errors.ConfigError, match="does not exist"):
    config.resolve_config([f"model_file={tmp_path / 'missing.yml'}"])
