"""DeepSeek mixture of experts: router (`gate`), routed experts (`MoeBlock_0`) and shared experts.

`RoutedAndSharedMoE` is MaxText's `DeepSeekMoeBlock_0`: `MoeBlock_0(x) + shared_experts(x)`.
`RoutedMoE` (`MoeBlock_0`) routes each token to K experts and runs MaxText's dropless sorted path:
tokens repeated K times, sorted by expert, three grouped matmuls (`quant.gmm.op.gmm`, asked from a method
of this module so that Qwix attributes its rule lookup to `.../MoeBlock_0`; or `jax.lax.ragged_dot`
with `megablox=false`), unsorted, and combined with one float32 `jnp.einsum`. With `sparse_matmul=false` every
expert runs on every token (dense einsums); `capacity_factor > 0` then drops tokens as MaxText does: each expert
takes at most C = max(ceil(S·K/X)·capacity_factor, capacity_factor) of a sequence's S·K assignments, in
(position, k) order, and the rest are dropped (MaxText's dispatch/combine masks).

Routing (facts §4.6): DeepSeek-V3 names (`cfg.deepseek_routing`) select experts on sigmoid scores plus
the gate bias and weight them with the unbiased scores; other names take top-k of the (biased) scores.
DeepSeek blocks then renormalise sigmoid weights and multiply by `routed_scaling_factor`.
"""

from __future__ import annotations

import math

from flax import nnx
import jax
import jax.numpy as jnp

from inspect_tool import errors
from inspect_tool.model import initializers as inits
from inspect_tool.model import layers
from inspect_tool.model import moe_dispatch
from inspect_tool.model import partitioning
from inspect_tool.model import remat
from quant.gmm import backends as gmm_backends
from quant.gmm import op as gmm_lib
from quant.gmm import tiles as gmm_tiles


class MoEBiasVar(nnx.Variable):
  """MaxText's non-Param gate bias of DeepSeek-V3 routers (kept in `nnx_aux` in training checkpoints)."""


class Tid2EidVar(nnx.Variable):
  """DeepSeek-V4's token id → expert ids table of a hash-routed layer (vocab, K), float32, not a Param."""


class moe_lb_loss(nnx.Intermediate):  # pylint: disable=invalid-name
  """A routed layer's load-balance loss (MaxText's intermediate of that name), with `load_balance_loss_weight`."""


def _score(name: str, x: jax.Array) -> jax.Array:
  if name == "sqrtsoftplus":  # DeepSeek-V4
    return jnp.sqrt(jax.nn.softplus(x))
  if name == "sigmoid":
    return jax.nn.sigmoid(x)
  if name == "softmax":
    return jax.nn.softmax(x)
  return x


def gmm_tiles_of(cfg, matmul: str) -> gmm_tiles.Tiles:
  """The Pallas kernels' tiles of `matmul` ("wi" or "wo"): MaxText's 18 tile keys when any is given (those not given
  at MaxText's default), else the tilings measured fastest per shape (`quant.gmm.tiles.auto`)."""
  if not any(key in cfg.passthrough for key in gmm_tiles.KEYS):
    return gmm_tiles.Tiles()
  try:
    return gmm_tiles.from_keys(lambda key: gmm_tiles.check(getattr(cfg, key), key), matmul)
  except ValueError as e:
    raise errors.ConfigError(str(e)) from None


class GateLogit(nnx.Module):
  """Router: `score(x @ kernel)` (+ `bias`), all in the gate dtype; returns (scores, unbiased or None)."""

  def __init__(self, cfg, make: inits.VariableFactory, hash_routing: bool = False):
    e, x = cfg.emb_dim, cfg.num_experts
    self.dtype = jnp.dtype(jnp.float32 if cfg.float32_gate_logits else cfg.dtype)
    self.precision = layers.precision(cfg)
    self.score_func = cfg.routed_score_func
    self.keep_unbiased = bool(cfg.deepseek_routing)
    self.kernel = make.make((e, x), inits.dense((0,)))
    if cfg.routed_bias and not hash_routing:
      self.bias = make.make((x,), inits.zeros, kind=MoEBiasVar if cfg.deepseek_routing else nnx.Param)
    else:
      self.bias = None

  def __call__(self, x: jax.Array):
    x = jnp.asarray(x, self.dtype)
    kernel = layers.kernel_value(self.kernel, self.dtype)
    out = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())), precision=self.precision)
    out = _score(self.score_func, out)
    unbiased = out if self.keep_unbiased else None
    if self.bias is not None:
      out = out + jnp.asarray(self.bias[...], self.dtype)
    return out, unbiased


class RoutedMoE(nnx.Module):
  """MaxText's `RoutedMoE` with expert weights `wi_0`, `wi_1` (X, E, Fm) and `wo` (X, Fm, E)."""

  def __init__(self, cfg, make: inits.VariableFactory, hash_routing: bool = False):
    e, x, f = cfg.emb_dim, cfg.num_experts, cfg.moe_mlp_dim
    self.dtype = layers.compute_dtype(cfg)
    self.precision = layers.precision(cfg)
    self.num_experts = x
    self.top_k = cfg.num_experts_per_tok
    self.deepseek_routing = bool(cfg.deepseek_routing)
    self.score_func = cfg.routed_score_func
    self.scaling_factor = float(cfg.routed_scaling_factor)
    self.n_groups = cfg.n_routing_groups
    self.top_groups = cfg.topk_routing_group
    self.float32_weight_sum = bool(cfg.float32_weight_sum)
    self.sparse_matmul = bool(cfg.sparse_matmul)
    self.capacity_factor = float(cfg.capacity_factor)
    self.megablox = bool(cfg.megablox)
    self.gmm_backend = gmm_backends.requested(cfg.gmm_backend, use_tokamax_backend=cfg.use_tokamax_backend)
    self.wi_tiles, self.wo_tiles = gmm_tiles_of(cfg, "wi"), gmm_tiles_of(cfg, "wo")
    self.activations_limit = float(cfg.mlp_activations_limit)  # > 0: DeepSeek-V4 clips the expert activations
    self.lb_weight = 0.0 if hash_routing else float(cfg.load_balance_loss_weight)
    self.gate = GateLogit(cfg, make, hash_routing)
    # DeepSeek-V4's first layers route by token id (`first_num_hash_layers`).
    self.tid2eid = (make.make((cfg.vocab_size, cfg.num_experts_per_tok), inits.zeros, kind=Tid2EidVar,
                              dtype=jnp.float32) if hash_routing else None)
    self.wi_0 = make.make((x, e, f), inits.dense((1,)))
    self.wi_1 = make.make((x, e, f), inits.dense((1,)))
    self.wo = make.make((x, f, e), inits.dense((1,)))

  # Routing ---------------------------------------------------------------------------------------------
  def _group_mask(self, scores: jax.Array) -> jax.Array:
    grouped = jnp.reshape(scores, scores.shape[:-1] + (self.n_groups, -1))
    top2, _ = jax.lax.top_k(grouped, k=2)
    group_scores = jnp.sum(top2.astype(jnp.float32), axis=-1)
    _, group_idx = jax.lax.top_k(group_scores, k=self.top_groups)
    mask = jnp.sum(jax.nn.one_hot(group_idx, self.n_groups, dtype=jnp.float32), axis=-2)
    mask = jnp.broadcast_to(mask[..., None], mask.shape + (self.num_experts // self.n_groups,))
    return jnp.reshape(mask, mask.shape[:-2] + (self.num_experts,))

  def route(self, scores: jax.Array, unbiased: jax.Array | None, input_ids: jax.Array | None = None):
    """(weights, expert indices), both [B, S, K]."""
    if self.tid2eid is not None:
      idx = jnp.asarray(self.tid2eid[...]).astype(jnp.int32)[input_ids.astype(jnp.int32)]
      weights = jnp.take_along_axis(scores if unbiased is None else unbiased, idx, axis=-1)
    elif self.deepseek_routing:
      if self.n_groups > 0:
        scores = jnp.where(self._group_mask(scores) > 0, scores, -jnp.inf)
      _, idx = jax.lax.top_k(scores, k=self.top_k)
      weights = jnp.take_along_axis(unbiased, idx, axis=-1)
    else:
      weights, idx = jax.lax.top_k(scores, k=self.top_k)
    if self.score_func in ("sigmoid", "sqrtsoftplus"):
      weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    weights = weights * self.scaling_factor
    return weights, idx

  # Experts ---------------------------------------------------------------------------------------------
  def _grouped_matmul(self, lhs, rhs, group_sizes, matmul: str):
    if self.megablox:
      return gmm_lib.gmm(lhs, rhs, group_sizes, preferred_element_type=self.dtype, backend=self.gmm_backend,
                         tiles=self.wi_tiles if matmul == "wi" else self.wo_tiles)
    if gmm_lib.prequantized(rhs) is not None:  # an FP8 export's experts: Qwix QT's quantized ragged_dot
      return gmm_lib.prequantized_ragged_dot(lhs, rhs, group_sizes, preferred_element_type=self.dtype)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=self.dtype)

  def _activation(self, up0, up1):
    if self.activations_limit > 0:
      up0 = jnp.clip(up0, None, self.activations_limit)
      up1 = jnp.clip(up1, -self.activations_limit, self.activations_limit)
    return (jax.nn.silu(up0) * up1).astype(self.dtype)

  def _sparse(self, x, weights, idx, w0, w1, wo):
    b, s, e = x.shape
    tokens = jnp.reshape(x, (b * s, e))
    flat = jnp.ravel(idx)
    order = jnp.argsort(flat)
    rows = jnp.take(jnp.repeat(tokens, self.top_k, axis=0), order, axis=0).astype(self.dtype)
    group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
    up0 = remat.name(self._grouped_matmul(rows, w0, group_sizes, "wi"), "mlpwi_0", "moe_mlpwi_0")
    up1 = remat.name(self._grouped_matmul(rows, w1, group_sizes, "wi"), "moe_mlpwi_1")
    hidden = self._activation(up0, up1)
    down = remat.name(self._grouped_matmul(hidden, wo, group_sizes, "wo"), "mlpwo", "moe_mlpwo")
    down = jnp.take(down, jnp.argsort(order), axis=0)
    down = jnp.reshape(down, (b * s, self.top_k, e))
    weights = jnp.reshape(weights, (b * s, self.top_k))
    if self.float32_weight_sum:
      down, weights = down.astype(jnp.float32), weights.astype(jnp.float32)
    out = jnp.einsum("BKE,BK -> BE", down, weights, precision=self.precision)
    return jnp.reshape(out, (b, s, e)).astype(self.dtype)

  def _dense(self, x, weights, idx, w0, w1, wo):
    combine = jnp.sum(jax.nn.one_hot(idx, self.num_experts, dtype=weights.dtype) * weights[..., None], axis=-2)
    if self.capacity_factor > 0:
      return self._dense_dropping(x, combine, idx, w0, w1, wo)
    up0 = jnp.einsum("BSM,EMH->BSEH", x, w0, precision=self.precision)
    up1 = jnp.einsum("BSM,EMH->BSEH", x, w1, precision=self.precision)
    hidden = self._activation(up0, up1)
    down = jnp.einsum("BSEH,EHM->BSEM", hidden, wo, precision=self.precision)
    if self.float32_weight_sum:
      down, combine = down.astype(jnp.float32), combine.astype(jnp.float32)
    out = jnp.einsum("BSEM,BSE->BSM", down, combine, precision=self.precision)
    return out.astype(self.dtype)

  def capacity_masks(self, combine: jax.Array, idx: jax.Array):
    """MaxText's token dropping: (dispatch [B,S,X,C] bool, combine [B,S,X,C] weights) from the routing."""
    b, s, k = idx.shape
    capacity = int(max(math.ceil(s * k / self.num_experts) * self.capacity_factor, self.capacity_factor))
    chosen = jax.nn.one_hot(idx, self.num_experts, dtype=jnp.int32)  # [B, S, K, X]
    count = jnp.reshape(jnp.cumsum(jnp.reshape(chosen, (b, s * k, -1)), axis=1), chosen.shape)  # arrival order
    kept = jnp.sum(chosen * (count <= capacity), axis=2)  # [B, S, X]: 1 where the expert still had room
    slot = jnp.sum(chosen * count, axis=2) * kept  # 1-based slot in the expert's capacity, 0 when dropped
    masks = (combine * kept)[..., None] * jax.nn.one_hot(slot, capacity + 1, dtype=jnp.int32)
    masks = masks[..., 1:]
    return masks.astype(bool), masks

  def _dense_dropping(self, x, combine, idx, w0, w1, wo):
    dispatch, combine = self.capacity_masks(combine, idx)
    routed = jnp.einsum("BSM,BSEC->EBCM", x, dispatch, precision=self.precision)
    up0 = jnp.einsum("EBCM,EMH->EBCH", routed, w0, precision=self.precision)
    up1 = jnp.einsum("EBCM,EMH->EBCH", routed, w1, precision=self.precision)
    hidden = self._activation(up0, up1)
    down = jnp.einsum("EBCH,EHM->EBCM", hidden, wo, precision=self.precision)
    return jnp.einsum("EBCM,BSEC->BSM", down, combine, precision=self.precision).astype(self.dtype)

  def load_balance_loss(self, idx: jax.Array, probs: jax.Array) -> jax.Array:
    """MaxText's per-sequence load-balance loss: mean over sequences and experts of (the share of the sequence's
    top-k picks an expert got) × (its mean router probability), × experts² × `load_balance_loss_weight`."""
    picks = jnp.sum(jax.nn.one_hot(idx, self.num_experts, dtype=jnp.int32), axis=2)
    density = jnp.mean(picks, axis=1) / self.top_k
    return jnp.mean(density * jnp.mean(probs, axis=1)) * self.num_experts**2 * self.lb_weight

  def __call__(self, x: jax.Array, input_ids: jax.Array | None = None) -> jax.Array:
    x = x.astype(self.dtype)
    scores, unbiased = self.gate(x)
    weights, idx = self.route(scores, unbiased, input_ids)
    if self.lb_weight > 0:  # on the scores before the gate bias (the bias takes no gradient from it)
      pre_bias = scores if unbiased is None else unbiased
      probs = jax.nn.softmax(pre_bias.astype(jnp.float32), axis=-1).astype(self.dtype)
      self.lb_loss = moe_lb_loss(self.load_balance_loss(idx, probs))
    w0 = layers.kernel_value(self.wi_0, self.dtype)  # a WithAux of fp8 values when loaded from an FP8 export
    w1 = layers.kernel_value(self.wi_1, self.dtype)
    wo = layers.kernel_value(self.wo, self.dtype)
    if self.sparse_matmul:
      part = partitioning.active()
      if part is not None:  # traced for a device mesh: per device, as MaxText runs it there
        return moe_dispatch.routed_experts(self, part, x, weights, idx, w0, w1, wo)
      return self._sparse(x, weights, idx, w0, w1, wo)
    return self._dense(x, weights, idx, w0, w1, wo)


class RoutedAndSharedMoE(nnx.Module):
  """MaxText's `DeepSeekMoeBlock_0`: routed experts plus one wide shared-expert MLP (S·Fm)."""

  def __init__(self, cfg, make: inits.VariableFactory, hash_routing: bool = False):
    self.MoeBlock_0 = RoutedMoE(cfg, make, hash_routing)  # pylint: disable=invalid-name
    width = cfg.shared_experts * cfg.moe_mlp_dim
    self.shared_experts = layers.MlpBlock(cfg, cfg.emb_dim, width, make) if width else None

  def __call__(self, x: jax.Array, input_ids: jax.Array | None = None) -> jax.Array:
    routed = self.MoeBlock_0(x, input_ids)
    if self.shared_experts is None:
      return routed
    return routed + self.shared_experts(x)
