"""Summary by group: grouping of MaxText keys, byte sizes, active parameters per token."""

from inspect_tool import summary, tree


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
  assert mtp.bytes_bf16 == 2 * mtp.params and mtp.bytes_fp8 == mtp.params
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
