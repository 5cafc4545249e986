"""The terms of the training step's estimate (`inspect_tool/sharding/activations.py`), worked out by hand from its
documented formula with the sizes of deepseek3-tiny cut to 4 layers (E 64, H 4, qk 128 + 64, v 128, M 64, mlp 64,
16 experts, 8 per token, V 1024, yarn RoPE over 163840 positions), bf16 compute (a = 2), batch 2 × 256 (T = 512).
On TPU every array is laid out in (8, 128) tiles: a 64-wide minor dimension takes 128 lanes, 192 takes 256, and
fewer than 8 rows of a 16-bit type take 4 (`tpu_layout`). The estimate's total against XLA's own TPU figures is
`tests/test_xla_grid.py`'s.
"""

import dataclasses

import pytest

from inspect_tool.configuration import config
from inspect_tool.listings import model_listing
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import activations
from inspect_tool.sharding import placement

L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024", "per_device_batch_size=2", "max_target_length=256"]
MESH = {"fsdp": 4, "expert": 2}


@pytest.fixture(scope="module")
def cfg():
  return config.resolve_config(L4)


def _layout(tpu: bool, **sizes) -> activations.StepLayout:
  return activations.StepLayout(MESH, tpu, sizes.get("copies", 0.0), sizes.get("grads", 0.0),
                                sizes.get("gathered", 0.0), sizes.get("state_padding", 0.0))


def test_the_tensors_each_remat_policy_saves_are_sized_in_tpu_tiles(cfg):
  tokens, layers = 512, 4
  layer_input = tokens * 128 * 2  # E 64 -> 128 lanes
  assert activations.saved(cfg, _layout(True), 2, 256, "full") == layers * layer_input == 524_288
  assert activations.saved(cfg, _layout(False), 2, 256, "full") == layers * tokens * 64 * 2
  rows = 512 * 8 * 2  # T·K, times min(expert parallelism 2, 16 experts / 8 per token)
  qk = tokens * 256 * 4 * 2  # (heads 4, 192 -> 256 lanes) per token
  v = tokens * 128 * 4 * 2
  moe = 3 * rows * 128 * 2 * 2  # wi_0 (R·M) and wo (R·E), 64 -> 128 lanes, in the 3 MoE layers
  shared = 3 * tokens * 128 * 2 * 2  # the shared expert's wi_0 and wi_1 outputs (its output, like any MLP's, not kept)
  dense = tokens * 128 * 2 * 2  # wi_0 and wi_1 of the dense layer
  minimal = layers * 2 * layer_input + layers * (2 * qk + v) + moe + shared + dense
  assert activations.saved(cfg, _layout(True), 2, 256, "minimal") == minimal == 25_165_824
  assert activations.saved(cfg, _layout(True), 2, 256, "save_qkv_proj") == layers * (layer_input + 2 * qk + v)


def test_moe_rows_take_maxtexts_worst_case_ragged_buffer_with_expert_parallelism(cfg):
  assert activations.moe_rows(cfg, {"fsdp": 8}, 512) == 512 * 8
  assert activations.moe_rows(cfg, {"expert": 2}, 512) == 512 * 8 * 2
  assert activations.moe_rows(cfg, {"expert": 8}, 512) == 512 * 8 * 2  # capped at experts / per token


def test_yarn_rope_tables_span_max_position_embeddings_laid_out_128_lanes_wide(cfg):
  assert activations.rope_tables(cfg, _layout(True)) == 2 * 163840 * 128 * 4 == 167_772_160
  assert activations.rope_tables(cfg, _layout(False)) == 2 * 163840 * 32 * 4
  assert activations.rope_tables(dataclasses.replace(cfg, rope_type="default"), _layout(True)) == 0


def test_the_share_that_follows_the_state_is_what_doubling_the_state_adds(cfg):
  """Doubling the per-device state (weight copies, gradients, padding) changes the estimate by its `with_state`."""
  sizes = {"copies": 3e6, "grads": 6e6, "state_padding": 1e6}
  for vocab, phase in ((1024, "backward"), (129280, "loss")):  # the full vocabulary's logits peak in the loss
    at = dataclasses.replace(cfg, vocab_size=vocab)
    one = activations.estimate(at, _layout(True, **sizes), gradients=6e6)
    two = activations.estimate(at, _layout(True, **{k: 2 * v for k, v in sizes.items()}), gradients=12e6)
    assert one.phase == two.phase == phase
    assert two.total - one.total == one.with_state and one.fixed == one.total - one.with_state


def test_the_layout_holds_the_stacks_weights_in_bf16_and_their_float32_gradients(cfg):
  """Without TPU tiles, the copies are half the float32 stacks' bytes and the gradients all of them (the shard
  shapes of the `moe stack` and `dense stack` groups); in TPU tiles both take more."""
  leaves = model_listing.model_listing(cfg, include_all=False, source="", key_filter=None, fp8_column=False)[0].leaves
  plan = placement.plan(leaves, cfg, 8)
  stacks = sum(plan.of(leaf).shard_size * 4 for leaf in leaves if leaf.is_param and summary_lib.group_of(leaf)[0] in ("moe stack", "dense stack"))
  layout = activations.layout_of(leaves, plan, cfg, optimizer="adamw", tpu=False)
  assert layout.stack_copies * 2 == layout.stack_grads == stacks
  assert layout.padding == 0
  tiled = activations.layout_of(leaves, plan, cfg, optimizer="adamw", tpu=True)
  assert tiled.stack_copies > layout.stack_copies and tiled.state_padding > 0


def test_a_step_without_a_loss_holds_no_activations_and_no_gradients(cfg):
  """An indexer's dense warm-up leaves the main loss out (MaxText 0.2.5); without MTP and load balancing the step then
  has no loss term at all, and XLA keeps neither the forward nor the gradients (deepseek-custom: temporaries of
  15.5 MiB at 2048 tokens, tests/data/xla_family): the estimate is the code and the state's padding, less the
  gradients the plan counts apart."""
  warmup = config.resolve_config(["model_name=deepseek-custom", "override_model_config=true", "engram_layers=[]",
                                   "attention=dot_product"])
  layout = _layout(True, grads=6e6, state_padding=1e6)
  est = activations.estimate(warmup, layout, gradients=6e6)
  assert not activations.has_loss(warmup) and est.phase == "step without a loss"
  assert est.total == activations.CODE_BASE + 1e6 - 6e6
  for keys in (["mtp_num_layers=1"], ["load_balance_loss_weight=0.01"], ["indexer_sparse_training=true"]):
    with_loss = config.resolve_config(["model_name=deepseek-custom", "override_model_config=true", "engram_layers=[]",
                                       "attention=dot_product", *keys])
    assert activations.has_loss(with_loss)
    assert activations.estimate(with_loss, layout, gradients=6e6).phase != est.phase
