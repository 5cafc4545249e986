"""Summary by group: grouping of MaxText keys, byte sizes, active parameters per token."""

from inspect_tool.paramtree import summary
from inspect_tool.paramtree import tree


def _leaf(path, shape, dtype="float32"):
  return tree.Leaf(tree.param_key(tuple(path.split("/"))), shape, dtype)


LEAVES = [
    _leaf("token_embedder/embedding", (100, 8)),
    _leaf("decoder/logits_dense/kernel", (8, 100)),
    _leaf("decoder/decoder_norm/scale", (8,)),
    _leaf("decoder/dense_layers/mlp/wi_0/kernel", (8, 1, 16)),
    _leaf("decoder/moe_layers/self_attention/wq_a/kernel", (8, 2, 4)),
    _leaf("decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel", (8, 2, 4)),
    _leaf("decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0", (4, 2, 8, 16)),
    _leaf("decoder/moe_layers/DeepSeekMoeBlock_0/shared_experts/wo/kernel", (16, 2, 8)),
    _leaf("mtp_block/mtp_layer_1/mtp_1_projection/kernel", (16, 8)),
    _leaf("mtp_block/mtp_layer_1/mtp_1_transformer_layer/DeepSeekMoeBlock_0/MoeBlock_0/wo", (4, 16, 8), "bfloat16"),
    tree.Leaf(tree.aux_key(("decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")), (2, 4),
              "float32"),
]


def test_groups_and_parts():
  assert summary.group_of(LEAVES[0]) == ("embedding", "")
  assert summary.group_of(LEAVES[1]) == ("head", "")
  assert summary.group_of(LEAVES[5]) == ("moe stack", "router")
  assert summary.group_of(LEAVES[6]) == ("moe stack", "routed experts")
  assert summary.group_of(LEAVES[7]) == ("moe stack", "shared experts")
  assert summary.group_of(LEAVES[4]) == ("moe stack", "attention and norms")
  assert summary.group_of(LEAVES[9]) == ("mtp block", "routed experts")


def test_totals_count_params_only_and_bytes_follow_dtype():
  s = summary.summarize(LEAVES)
  params = sum(l.size for l in LEAVES if l.is_param)
  assert s.total_params == params
  mtp = next(r for r in s.rows if r.group == "mtp block" and not r.part)
  assert mtp.params == 16 * 8 + 4 * 16 * 8 and mtp.bytes == 16 * 8 * 4 + 4 * 16 * 8 * 2
  assert mtp.bytes_bf16 == 2 * mtp.params and mtp.bytes_fp8 is None  # no rules given: the fp8 size is unknown
  assert s.active_params is None


def test_active_parameters_scale_routed_experts_only():
  s = summary.summarize(LEAVES, routed_fraction=0.25)
  routed = 4 * 2 * 8 * 16
  mtp_routed = 4 * 16 * 8
  mtp_total = 16 * 8 + mtp_routed
  assert s.active_params == s.total_params - mtp_total - round(routed * 0.75)
  assert s.active_params_with_mtp == s.total_params - round(routed * 0.75) - round(mtp_routed * 0.75)


def test_human_units():
  assert summary.human(682636472320) == "682.64B" and summary.human(999) == "999"
  assert summary.human_bytes(3 * 2**30) == "3.00 GiB"


def test_hugging_face_names_are_grouped_by_layer_kind(tmp_path):
  from inspect_tool.hf import layout as hf_layout  # pylint: disable=import-outside-toplevel

  def hf(name, shape=(4, 4), dtype="bfloat16"):
    return tree.Leaf(tuple(name.split(".")), shape, dtype)

  leaves = [hf("model.embed_tokens.weight"), hf("lm_head.weight"), hf("model.norm.weight", (4,)),
            hf("model.layers.0.mlp.gate_proj.weight"), hf("model.layers.0.self_attn.o_proj.weight"),
            hf("model.layers.1.mlp.gate.weight"), hf("model.layers.1.mlp.experts.3.up_proj.weight", dtype="float8_e4m3fn"),
            hf("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv", (1, 1), "float32"),
            hf("model.layers.1.mlp.shared_experts.down_proj.weight"), hf("model.layers.1.self_attn.q_a_proj.weight"),
            hf("model.layers.2.eh_proj.weight"), hf("model.layers.2.embed_tokens.weight"),
            hf("model.layers.2.mlp.experts.0.gate_proj.weight"), hf("model.layers.2.input_layernorm.weight", (4,))]
  classify = hf_layout.classifier(leaves)
  assert [classify(l) for l in leaves] == [
      ("embedding", ""), ("head", ""), ("head", ""), ("dense stack", ""), ("dense stack", ""),
      ("moe stack", "router"), ("moe stack", "routed experts"), ("moe stack", "routed experts"),
      ("moe stack", "shared experts"), ("moe stack", "attention and norms"),
      ("mtp block", "attention, norms and projection"), ("mtp block", "embedding and head copies"),
      ("mtp block", "routed experts"), ("mtp block", "attention, norms and projection")]
  (tmp_path / "config.json").write_text('{"num_experts_per_tok": 8, "n_routed_experts": 256}')
  assert hf_layout.routed_fraction(str(tmp_path)) == 8 / 256
  (tmp_path / "no_config").mkdir()
  assert hf_layout.routed_fraction(str(tmp_path / "no_config")) is None
  s = summary.summarize(leaves, all_leaves=True, classify=classify, routed_fraction=0.5)
  assert s.total_params == sum(l.size for l in leaves) and s.active_params is not None


def test_the_v4_hyper_head_is_the_heads_mhc_part_and_classify_path_is_group_of():
  head = [_leaf("decoder/hc_head/hc_fn", (256, 4)), _leaf("decoder/hc_head/hc_base", (4,)),
          _leaf("decoder/hc_head/hc_scale", (1,)), LEAVES[1], LEAVES[2]]
  rows = {(r.group, r.part): r.params for r in summary.summarize(head).rows}
  assert rows == {("head", ""): 256 * 4 + 4 + 1 + 8 * 100 + 8, ("head", "mHC mixing"): 256 * 4 + 4 + 1}
  for leaf in LEAVES + head:
    assert summary.classify_path("/".join(leaf.module_path)) == summary.group_of(leaf)
