"""DeepSeek decoder layers and the decoder: embedding → layer stacks → `decoder_norm` → `logits_dense`.

With `scan_layers=true` the decoder holds one `dense_layers` and one `moe_layers` module whose variables
are stacked over the layers (Params: layer axis at `param_scan_axis`; the `MoEBiasVar` gate bias: axis 0),
and applies them with `jax.lax.scan`, re-creating the layer in the scan body with `nnx.merge` so that
static module attributes (Qwix's `qwix_path`) survive. With `scan_layers=false` it holds
`dense_layers_{i}` and `moe_layers_{j}` (MoE numbering restarts at 0).
"""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool.model import attention
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import mhc
from inspect_tool.model import moe
from inspect_tool.model import partitioning
from inspect_tool.model import remat

EMBED_ACTIVATION = ("activation_batch", "activation_norm_length", "activation_embed")  # MaxText's layer activations
LOGITS = ("activation_embed_and_logits_batch", "activation_length", "activation_vocab")


class DeepSeekLayer(nnx.Module):
  """Shared part of both layer kinds: pre-norm MLA with residual, then the post-attention norm."""

  def __init__(self, cfg, make: inits.VariableFactory):
    self.pre_self_attention_layer_norm = layers.RMSNorm(cfg, cfg.emb_dim, make)
    self.post_self_attention_layer_norm = layers.RMSNorm(cfg, cfg.emb_dim, make)
    self.self_attention = attention.MLA(cfg, make)
    if cfg.mhc_expansion_rate > 1:  # hyper-connections around both branches (deepseek-custom)
      self.mhc_attention = mhc.ManifoldConstrainedHyperConnections(cfg, make)
      self.mhc_mlp = mhc.ManifoldConstrainedHyperConnections(cfg, make)
    else:
      self.mhc_attention = self.mhc_mlp = None

  def _apply(self, x, segment_ids, positions, mlp):
    """Attention then `mlp`, each with its pre-norm and residual (or mHC mixing of the k streams of x)."""
    if self.mhc_attention is None:
      pin = lambda a: partitioning.constrain(a, EMBED_ACTIVATION)  # pylint: disable=unnecessary-lambda-assignment
      x = remat.name(pin(x), "decoder_layer_input")
      attended = pin(self.self_attention(pin(self.pre_self_attention_layer_norm(x)), positions, segment_ids))
      residual = x + attended
      return pin(pin(mlp(pin(self.post_self_attention_layer_norm(residual)))) + residual)
    residual = self.mhc_attention(self.pre_self_attention_layer_norm,
                                  lambda h: self.self_attention(h, positions, segment_ids), x)
    self.post_self_attention_layer_norm(residual)  # MaxText computes (and drops) it too: Qwix sees its einsum
    return self.mhc_mlp(self.post_self_attention_layer_norm, mlp, residual)


class DeepSeekDenseLayer(DeepSeekLayer):
  """MLA + dense gated MLP (`mlp`, width `mlp_dim`)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    super().__init__(cfg, make)
    self.mlp = layers.MlpBlock(cfg, cfg.emb_dim, cfg.mlp_dim, make)

  def __call__(self, inputs, decoder_segment_ids=None, decoder_positions=None):
    return self._apply(inputs, decoder_segment_ids, decoder_positions, self.mlp)


class DeepSeekMoELayer(DeepSeekLayer):
  """MLA + routed and shared experts (`DeepSeekMoeBlock_0`)."""

  def __init__(self, cfg, make: inits.VariableFactory):
    super().__init__(cfg, make)
    self.DeepSeekMoeBlock_0 = moe.RoutedAndSharedMoE(cfg, make)  # pylint: disable=invalid-name

  def __call__(self, inputs, decoder_segment_ids=None, decoder_positions=None):
    return self._apply(inputs, decoder_segment_ids, decoder_positions, self.DeepSeekMoeBlock_0)


def _move_layer_axis(state, param_scan_axis: int, to_front: bool):
  """Moves the layer axis of stacked Params between `param_scan_axis` and 0 (other state stays at 0)."""
  def move(a):
    axis = inits.layer_axis(a.ndim - 1, param_scan_axis)
    return jnp.moveaxis(a, axis, 0) if to_front else jnp.moveaxis(a, 0, axis)
  return jax.tree.map(move, state)


def apply_stack(stack: nnx.Module, param_scan_axis: int, x, segment_ids, positions, *, dynamic: bool = False,
                remat_policy: str | None = None, cfg=None):
  """Runs a scanned stack of layers over `x` (the stack's variables carry the layer axis).

  Returns (y, new stack or None). With `dynamic` (Qwix's first, initialising call, when a provider such as
  PTQ may replace variables inside the layers) the layers' whole updated state is scanned out and a new
  stack module is returned, as MaxText's `_apply_layers_sequentially` does; otherwise only the non-Param
  state is written back into `stack`. `remat_policy` (MaxText's, `remat_policies.POLICIES`; `cfg` gives
  `custom`'s names) wraps the layer in `jax.checkpoint` with that policy's saved names, without preventing
  common subexpression elimination, as MaxText's scanned layers do; None or `none`: no `jax.checkpoint`.
  """
  graphdef, params, rest = nnx.split(stack, nnx.Param, ...)
  params = _move_layer_axis(params, param_scan_axis, to_front=True)
  new_graphdef = [graphdef]

  def body(carry, layer_state):
    layer = nnx.merge(graphdef, *layer_state)
    y = layer(carry, segment_ids, positions)
    layer_graphdef, layer_params, layer_rest = nnx.split(layer, nnx.Param, ...)
    if dynamic:
      new_graphdef[0] = layer_graphdef
      return y, (layer_params, layer_rest)
    return y, layer_rest

  if remat_policy not in (None, "none") and not dynamic:
    body = jax.checkpoint(body, policy=remat.policy(remat_policy, cfg), prevent_cse=False)
  y, scanned = jax.lax.scan(body, x, (params, rest))
  if dynamic:
    new_params, new_rest = scanned
    return y, nnx.merge(new_graphdef[0], _move_layer_axis(new_params, param_scan_axis, to_front=False), new_rest)
  nnx.update(stack, scanned)
  return y, None


class Decoder(nnx.Module):
  """MaxText's `NNXDecoder` for the DeepSeek block.

  `remat_policy` is None: the layers are not rematerialised (a forward pass has nothing to save). Set to one of
  MaxText's policies (`remat_policies.POLICIES`), a scanned stack saves for the backward pass what that policy
  names, as MaxText's training step does (`remat_cfg` gives `custom`'s names).
  """

  remat_policy: str | None = None
  remat_cfg = None

  def __init__(self, cfg, make: inits.VariableFactory):
    self._init_head(cfg, make)
    n_dense, n_moe = cfg.first_num_dense_layers, cfg.num_moe_layers
    self.num_dense_layers, self.num_moe_layers = n_dense, n_moe
    if self.scan_layers:
      self.dense_layers = DeepSeekDenseLayer(cfg, make.stacked(n_dense)) if n_dense else None
      self.moe_layers = DeepSeekMoELayer(cfg, make.stacked(n_moe)) if n_moe else None
    else:
      for i in range(n_dense):
        setattr(self, f"dense_layers_{i}", DeepSeekDenseLayer(cfg, make))
      for j in range(n_moe):
        setattr(self, f"moe_layers_{j}", DeepSeekMoELayer(cfg, make))

  def _init_head(self, cfg, make: inits.VariableFactory):
    """Settings and the output head (`decoder_norm`, `logits_dense`) shared by every DeepSeek decoder."""
    self.dtype = layers.compute_dtype(cfg)
    self.scan_layers = bool(cfg.scan_layers)
    self.param_scan_axis = cfg.param_scan_axis
    self.logits_via_embedding = bool(cfg.logits_via_embedding)
    self.logits_dtype = jnp.dtype(jnp.float32 if cfg.logits_dot_in_fp32 else cfg.dtype)
    self.cast_logits_to_fp32 = bool(cfg.cast_logits_to_fp32)
    self.mhc_expansion_rate = cfg.mhc_expansion_rate
    self.decoder_norm = layers.RMSNorm(cfg, cfg.emb_dim, make)
    if self.logits_via_embedding:
      self.logits_dense = None
    else:
      self.logits_dense = layers.DenseGeneral(cfg, cfg.emb_dim, cfg.vocab_size, make, dtype=self.logits_dtype)

  def layer_names(self) -> list[str]:
    """Attribute names of the per-layer modules (unscanned) or stacks (scanned), in application order."""
    if self.scan_layers:
      return [n for n, count in (("dense_layers", self.num_dense_layers), ("moe_layers", self.num_moe_layers))
              if count]
    return ([f"dense_layers_{i}" for i in range(self.num_dense_layers)]
            + [f"moe_layers_{j}" for j in range(self.num_moe_layers)])

  def apply_output_head(self, embedder, y, *, normalize: bool = True):
    """[B, S, E] hidden state → logits (float32 when `cast_logits_to_fp32`)."""
    if normalize:
      y = self.decoder_norm(y)
    if self.logits_dense is None:
      logits = embedder.attend(y, self.logits_dtype)
    else:
      logits = self.logits_dense(y)
    if self.cast_logits_to_fp32:
      logits = logits.astype(jnp.float32)
    return logits  # unconstrained, as MaxText leaves its main logits (the MTP block pins its own: `mtp`)

  def __call__(self, embedder, tokens, positions, segment_ids=None):
    """Returns (logits, hidden state before `decoder_norm`)."""
    y = partitioning.constrain(embedder(tokens).astype(self.dtype), EMBED_ACTIVATION)
    if self.mhc_expansion_rate > 1:
      y = mhc.expand(y, self.mhc_expansion_rate)
    dynamic = bool(getattr(self, "disable_quant_stats_update", False))  # set by Qwix for its first call
    for name in self.layer_names():
      layer = getattr(self, name)
      if self.scan_layers:
        y, new_stack = apply_stack(layer, self.param_scan_axis, y, segment_ids, positions, dynamic=dynamic,
                                   remat_policy=self.remat_policy, cfg=self.remat_cfg)
        if new_stack is not None:
          setattr(self, name, new_stack)
      else:
        y = layer(y, segment_ids, positions)
    if self.mhc_expansion_rate > 1:
      y = mhc.reduce(y)
    return self.apply_output_head(embedder, y), y
