"""The DeepSeek-V4 decoder (`decoder_block: deepseek4`), named and shaped as MaxText 0.2.5's.

Every layer is a MoE layer (`mlp`: routed experts `MoeBlock_0` plus `shared_experts`) behind compressed
attention (`self_attention`, see `compressed_attention`), both wrapped in mHC (`mhc_attention`, `mhc_mlp`)
over `mhc_expansion_rate` streams; the first `first_num_hash_layers` layers route tokens by id
(`MoeBlock_0/tid2eid`). Layer i's compressor follows `compress_ratios[i]`.

Tree: `scan_layers=true` keeps the hash layers unrolled (`layers_0` … `layers_{H-1}`) and scans the rest as
`scanned_blocks` of two layers, `layers_0` (compress ratio 128) and `layers_1` (4), as MaxText does whatever
`compress_ratios` says (an odd remainder layer is dropped, as in MaxText); `scan_layers=false` has
`layers_0` … `layers_{L-1}`. After the layers `hc_head` folds the streams, then `decoder_norm` and
`logits_dense`.
"""

from __future__ import annotations

from flax import nnx

from inspect_tool.model import compressed_attention
from inspect_tool.model import decoder as decoder_lib
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import mhc
from inspect_tool.model import moe

SCANNED_RATIOS = (128, 4)  # MaxText's DeepSeek4ScannableBlock: HCA then CSA


class DeepSeek4Layer(nnx.Module):
  """One DeepSeek-V4 layer (MaxText's `DeepSeek4DecoderLayer`)."""

  def __init__(self, cfg, ratio: int, hash_routing: bool, make: inits.VariableFactory):
    self.pre_self_attention_layer_norm = layers.RMSNorm(cfg, cfg.emb_dim, make)
    self.post_self_attention_layer_norm = layers.RMSNorm(cfg, cfg.emb_dim, make)
    self.self_attention = compressed_attention.CompressedAttention(cfg, ratio, make)
    self.mlp = moe.RoutedAndSharedMoE(cfg, make, hash_routing)
    self.mhc_attention = mhc.ManifoldConstrainedHyperConnections(cfg, make)  # V4 needs mhc_expansion_rate > 1
    self.mhc_mlp = mhc.ManifoldConstrainedHyperConnections(cfg, make)

  def __call__(self, x, segment_ids=None, positions=None, input_ids=None):
    residual = self.mhc_attention(self.pre_self_attention_layer_norm,
                                  lambda h: self.self_attention(h, positions, segment_ids), x)
    self.post_self_attention_layer_norm(residual)  # MaxText computes (and drops) it too: Qwix sees its einsum
    return self.mhc_mlp(self.post_self_attention_layer_norm, lambda h: self.mlp(h, input_ids), residual)


class DeepSeek4Block(nnx.Module):
  """MaxText's `DeepSeek4ScannableBlock`: `layers_0` (HCA, ratio 128) then `layers_1` (CSA, ratio 4)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    for i, ratio in enumerate(SCANNED_RATIOS):
      setattr(self, f"layers_{i}", DeepSeek4Layer(cfg, ratio, False, make))

  def __call__(self, x, segment_ids=None, positions=None):
    for i in range(len(SCANNED_RATIOS)):
      x = getattr(self, f"layers_{i}")(x, segment_ids, positions)
    return x


class Decoder(decoder_lib.Decoder):
  """MaxText's `NNXDecoder` for `decoder_block: deepseek4` (shares the output head with the DeepSeek decoder)."""

  def __init__(self, cfg, make: inits.VariableFactory):  # pylint: disable=super-init-not-called
    self._init_head(cfg, make)
    self.hc_head = mhc.HyperHead(cfg, make)
    ratios = [int(r) for r in cfg.compress_ratios]
    hashed = cfg.first_num_hash_layers
    self.num_hash_layers = hashed if self.scan_layers else cfg.num_decoder_layers
    for i in range(self.num_hash_layers):
      setattr(self, f"layers_{i}", DeepSeek4Layer(cfg, ratios[i], i < hashed, make))
    self.num_blocks = (cfg.num_decoder_layers - hashed) // 2 if self.scan_layers else 0
    self.scanned_blocks = DeepSeek4Block(cfg, make.stacked(self.num_blocks)) if self.num_blocks else None

  def layer_names(self) -> list[str]:
    return [f"layers_{i}" for i in range(self.num_hash_layers)] + (["scanned_blocks"] if self.num_blocks else [])

  def __call__(self, embedder, tokens, positions, segment_ids=None):
    """Returns (logits, hidden state before `decoder_norm`)."""
    y = embedder(tokens).astype(self.dtype)
    y = mhc.expand(y, self.mhc_expansion_rate)
    for i in range(self.num_hash_layers):
      y = getattr(self, f"layers_{i}")(y, segment_ids, positions, tokens)
    if self.scanned_blocks is not None:
      dynamic = bool(getattr(self, "disable_quant_stats_update", False))  # set by Qwix for its first call
      y, new_stack = decoder_lib.apply_stack(self.scanned_blocks, self.param_scan_axis, y, segment_ids, positions,
                                             dynamic=dynamic, remat_policy=self.remat_policy, cfg=self.remat_cfg)
      if new_stack is not None:
        self.scanned_blocks = new_stack
    y = self.hc_head(y)
    return self.apply_output_head(embedder, y), y
