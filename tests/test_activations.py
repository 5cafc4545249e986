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


def test_dot_product_attention_holds_four_score_arrays_per_key_length(cfg):
  """B·H·S·S_kv in bf16 per distinct key length, in TPU tiles; four of them in the backward (scores, probabilities
  and the gradients of both: `SCORES`). Splash attention's kernel keeps none."""
  dot = dataclasses.replace(cfg, attention="dot_product")
  assert activations.attention_scores(dot, _layout(True), 2, 256, 2) == 2 * 4 * 256 * 256 * 2 == 1_048_576
  assert activations.attention_scores(cfg, _layout(True), 2, 256, 2) == 0  # flash: the kernel's blocks
  parts = dict(activations.estimate(dot, _layout(True)).parts)
  assert parts["dot-product attention's score arrays in the backward"] == 4 * 1_048_576
  assert activations.SCORES == 4


def test_deepseek_v4_scores_take_a_key_length_per_compress_ratio_and_the_sink():
  """DeepSeek-V4 tiny (compress ratios 0, 4 and 128, 4 heads): keys of S + 1, S + S/4 + 1 and S + S/128 + 1 columns
  (the sink takes one), each padded to 128 lanes: at S = 256, 257, 321 and 259 all take 384."""
  v4 = config.resolve_config(["model_name=deepseek4-tiny", "attention=dot_product"])
  assert sorted({int(r) for r in v4.compress_ratios}) == [0, 4, 128] and v4.num_query_heads == 4
  assert activations.attention_scores(v4, _layout(True), 2, 256, 2) == 3 * 2 * 4 * 256 * 384 * 2 == 4_718_592
  assert activations.attention_scores(v4, _layout(False), 2, 256, 2) == 2 * 4 * 256 * (257 + 321 + 259) * 2


def test_deepseek_v4_saves_one_input_per_scanned_block_across_mhc_streams_and_no_attention_projection():
  """V4 tiny, 43 layers: 3 hash-routed layers unrolled and 20 scanned blocks of two, so 23 saved inputs, each of
  mHC's 4 streams (B·4·S·E, E 64 -> 128 lanes); its compressed attention names no projection, so `minimal` adds only
  the MLPs': per layer the routed experts' wi_0 (R·M) and wo (R·E) and the shared expert's wi_0 and wi_1 (T·64)."""
  v4 = config.resolve_config(["model_name=deepseek4-tiny", "attention=dot_product"])
  assert (v4.num_decoder_layers, v4.first_num_hash_layers, v4.num_moe_layers) == (43, 3, 43)
  full = 23 * (2 * 4) * 256 * 128 * 2
  assert activations.saved(v4, _layout(True), 2, 256, "full") == full == 12_058_624
  rows = 512 * 4 * 2  # T·K, times min(expert parallelism 2, 16 experts / 4 per token)
  per_layer = 2 * rows * 128 * 2 + 2 * 512 * 128 * 2
  assert activations.saved(v4, _layout(True), 2, 256, "minimal") == full + 43 * per_layer
  assert activations.saved(v4, _layout(True), 2, 256, "save_qkv_proj") == full  # names V4 does not have


def test_generated_code_grows_with_the_program_in_parameter_arrays(cfg):
  """The code term: (24 MiB + 0.8 MiB·√T) for deepseek3-tiny with MTP's 51 parameter arrays, in proportion for
  other programs; `layout_of` counts the arrays of the tree it places."""
  base = 24 * 2**20 + 0.8 * 2**20 * 16  # T = 256
  twice = dataclasses.replace(_layout(True), arrays=102)
  assert activations.code_size(_layout(True), 256) == base
  assert activations.code_size(twice, 256) == 2 * base
  leaves = model_listing.model_listing(cfg, include_all=False, source="", key_filter=None, fp8_column=False)[0].leaves
  layout = activations.layout_of(leaves, placement.plan(leaves, cfg, 8), cfg, optimizer="adamw")
  assert layout.arrays == sum(leaf.is_param for leaf in leaves) == activations.CODE_ARRAYS


def test_the_rope_tables_stay_beside_the_loss_only_when_the_logits_do_not_fit_their_space(cfg):
  """XLA's heap gives the yarn tables' space (160 MiB here) to the float32 logits when they fit in it: 2 × 512 tokens
  of a 38400 vocabulary (150 MiB) leave the loss phase no RoPE part; 1024 tokens of 129280 (505 MiB) keep them (seen
  in XLA's heaps of deepseek3-tiny with MTP: at 256 tokens on v5e-8 and v5p-8 the logits take the tables' offsets,
  at 1024 on v5p-8 the tables lie below them)."""
  name = "RoPE tables (yarn, max_position_embeddings positions)"
  small = activations.estimate(cfg, _layout(True))
  assert small.phase == "backward" and name in dict(small.parts)  # a layer's RoPE, in the backward loop
  fits = activations.estimate(dataclasses.replace(cfg, vocab_size=38400), _layout(True), batch=2, seq=512)
  assert fits.phase == "loss" and name not in dict(fits.parts)
  big = activations.estimate(dataclasses.replace(cfg, vocab_size=129280), _layout(True), batch=1, seq=1024)
  assert big.phase == "loss" and dict(big.parts)[name] == 2 * 163840 * 128 * 4
