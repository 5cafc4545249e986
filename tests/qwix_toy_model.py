"""A tiny NNX model shaped like MaxText's DeepSeek for the coverage tests (not a test module).

`Toy` has a scanned stack of MoE layers (layer axis of every Param at index 1, one trace per stack), a
dense output head that an MTP-like block calls a second time, an unscanned MTP layer, norms that use
`jnp.einsum`, a router `gate` that uses `jax.lax.dot_general`, and routed experts that either ask Qwix for a
"gmm" rule (`get_current_rule("gmm")`, as MaxText's Megablox gmm does) or call `jax.lax.ragged_dot`.
"""

import jax
from flax import nnx
from jax import numpy as jnp
from qwix._src import interception
from qwix._src import qconfig

DIM, FFN, EXPERTS, TOP_K, VOCAB, LAYERS = 8, 6, 4, 2, 32, 3


def _param(rngs: nnx.Rngs, *shape: int) -> nnx.Param:
  return nnx.Param(jax.random.normal(rngs.params(), shape) * 0.1)


class Dense(nnx.Module):

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.kernel = _param(rngs, din, dout)

  def __call__(self, x):
    kernel = self.kernel[...].astype(x.dtype)
    return jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


class Norm(nnx.Module):

  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.ones((dim,)))

  def __call__(self, x):
    return jnp.einsum("...d,d->...d", x, self.scale[...])


def gmm(lhs, rhs, group_sizes):
  """A grouped matmul that asks Qwix for its rule and computes out of Qwix's sight (like a Pallas kernel)."""
  rule = qconfig.get_current_rule("gmm")
  del rule  # a real kernel would quantize lhs/rhs with it
  return interception.disable_interceptions(jax.lax.ragged_dot)(lhs, rhs, group_sizes)


class Experts(nnx.Module):
  """Router + routed experts (bare Params wi_0/wi_1/wo, as MaxText's RoutedMoE)."""

  def __init__(self, *, use_gmm: bool, rngs: nnx.Rngs):
    self.gate = Dense(DIM, EXPERTS, rngs=rngs)
    self.wi_0 = _param(rngs, EXPERTS, DIM, FFN)
    self.wi_1 = _param(rngs, EXPERTS, DIM, FFN)
    self.wo = _param(rngs, EXPERTS, FFN, DIM)
    self.use_gmm = use_gmm

  def __call__(self, x):
    tokens = x.reshape(-1, DIM)
    weights, idx = jax.lax.top_k(self.gate(tokens), TOP_K)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat)
    xs = jnp.repeat(tokens, TOP_K, axis=0)[order]
    sizes = jnp.bincount(flat, length=EXPERTS).astype(jnp.int32)
    matmul = gmm if self.use_gmm else jax.lax.ragged_dot
    a = matmul(xs, self.wi_0[...], sizes)
    b = matmul(xs, self.wi_1[...], sizes)
    y = matmul(jax.nn.silu(a) * b, self.wo[...], sizes)
    y = y[jnp.argsort(order)].reshape(-1, TOP_K, DIM)
    return jnp.einsum("tkd,tk->td", y, weights).reshape(x.shape)


class Layer(nnx.Module):

  def __init__(self, *, use_gmm: bool, rngs: nnx.Rngs):
    self.norm = Norm(DIM)
    self.proj = Dense(DIM, DIM, rngs=rngs)
    self.MoeBlock_0 = Experts(use_gmm=use_gmm, rngs=rngs)

  def __call__(self, x):
    return x + self.MoeBlock_0(self.proj(self.norm(x)))


class Decoder(nnx.Module):

  def __init__(self, *, use_gmm: bool, rngs: nnx.Rngs):
    layer = Layer(use_gmm=use_gmm, rngs=rngs)
    graphdef, state = nnx.split(layer)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * LAYERS, axis=1) if a.ndim else a, state)
    self.layers = nnx.merge(graphdef, stacked)  # every Param gets the layer axis at index 1
    self.final_norm = Norm(DIM)
    self.head = Dense(DIM, VOCAB, rngs=rngs)

  def __call__(self, x):
    graphdef, params = nnx.split(self.layers)
    params = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), params)

    def body(h, layer_params):
      return nnx.merge(graphdef, layer_params)(h), None

    x, _ = jax.lax.scan(body, x, params)
    return x


class Mtp(nnx.Module):

  def __init__(self, *, use_gmm: bool, rngs: nnx.Rngs):
    self.proj = Dense(2 * DIM, DIM, rngs=rngs)
    self.layer = Layer(use_gmm=use_gmm, rngs=rngs)

  def __call__(self, emb, hidden, decoder: Decoder):
    h = self.layer(self.proj(jnp.concatenate([emb, hidden], axis=-1)))
    return decoder.head(h)


class Toy(nnx.Module):

  def __init__(self, *, use_gmm: bool = True, mtp: bool = True, rngs: nnx.Rngs):
    self.embed = _param(rngs, VOCAB, DIM)
    self.decoder = Decoder(use_gmm=use_gmm, rngs=rngs)
    self.mtp = Mtp(use_gmm=use_gmm, rngs=rngs) if mtp else None

  def __call__(self, tokens, *, targets=None):
    emb = self.embed[...][tokens]
    hidden = self.decoder(emb)
    logits = self.decoder.head(self.decoder.final_norm(hidden))
    if self.mtp is not None and targets is not None:
      self.mtp(self.embed[...][targets], hidden, self.decoder)
    return logits


def abstract_toy(**kwargs) -> Toy:
  return nnx.eval_shape(lambda: Toy(rngs=nnx.Rngs(0), **kwargs))
