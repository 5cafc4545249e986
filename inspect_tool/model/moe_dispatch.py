"""The routed experts on a device mesh, per device (`shard_map`), as MaxText 0.2.5's sparse path runs them.

Used by `moe.RoutedMoE` only inside `partitioning.partitioned` (a model traced for a mesh). Each device holds its
share of the tokens (`activation_batch`, `activation_norm_length`) and its experts (`exp`), with the expert weights
gathered over `fsdp` first (MaxText's `mlp_no_fsdp` specs). Per device: the token copies (K per token) are sorted
by expert; with expert parallelism (EP > 1 devices on the `exp` axes, the tokens sharded over them too) each copy
goes to the device of its expert by `ragged_all_to_all` into a buffer of MaxText's worst-case size (tokens·K ·
min(EP, experts / K), its `ragged_buffer_factor=-1`), is sorted again by local expert, multiplied by the grouped
matmul (the Pallas kernel on TPU), and sent back; the K outputs of a token are then summed with its weights (in
float32 with `float32_weight_sum`). Expert weights sharded over `mlp_no_fsdp` axes (tensor parallelism) give
partial sums that are added over those axes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from inspect_tool.model import partitioning
from inspect_tool.model import remat


def _axes(entry) -> tuple[str, ...]:
  return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _without(spec, axis: str) -> jax.sharding.PartitionSpec:
  """`spec` with mesh `axis` removed from every entry (MaxText's `remove_mesh_axes_from_partition_spec`)."""
  out = []
  for entry in spec:
    kept = tuple(a for a in _axes(entry) if a != axis)
    out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
  return jax.sharding.PartitionSpec(*out)


def _exclusive_cumsum(x, axis=-1):
  return jnp.cumsum(x, axis=axis) - x


def _route_to_experts(rows, group_sizes, *, num_experts: int, top_k: int, ep: int, axes: tuple[str, ...]):
  """Sends each sorted row to the device holding its expert; returns (rows grouped by local expert, local group
  sizes, what `_route_back` needs)."""
  local = num_experts // ep
  shard = jax.lax.axis_index(axes)
  per_shard = jnp.sum(group_sizes.reshape(ep, local), axis=1)  # rows this device sends to each device
  all_sizes = jax.lax.all_gather(per_shard, axes)  # [source, destination]
  buffer = rows.shape[0] * min(ep, num_experts // top_k)
  send_offsets = _exclusive_cumsum(per_shard)
  land_offsets = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < shard, all_sizes, 0), axis=0)  # in each receiver
  received_sizes = all_sizes[:, shard]
  received = jax.lax.ragged_all_to_all(rows, jnp.zeros((buffer, rows.shape[1]), rows.dtype), send_offsets,
                                       per_shard, land_offsets, received_sizes, axis_name=axes)
  counts = jax.lax.dynamic_slice_in_dim(jax.lax.all_gather(group_sizes, axes), shard * local, local, axis=1)
  expert = jnp.repeat(jnp.tile(jnp.arange(local, dtype=jnp.int32), ep), counts.reshape(-1),
                      total_repeat_length=buffer)
  expert = jnp.where(jnp.arange(buffer) < jnp.sum(counts), expert, local)  # padding rows last
  order = jnp.argsort(expert)
  back = (order, all_sizes, shard, per_shard, send_offsets, received_sizes)
  return jnp.take(received, order, axis=0), jnp.sum(counts, axis=0).astype(jnp.int32), back


def _route_back(out, back, rows: int, axes: tuple[str, ...]):
  """The expert outputs returned to the devices their rows came from, in the order they were sent."""
  order, all_sizes, shard, per_shard, send_offsets, received_sizes = back
  out = jnp.take(out, jnp.argsort(order), axis=0)
  received_offsets = _exclusive_cumsum(received_sizes)
  home_offsets = _exclusive_cumsum(all_sizes, axis=1)[:, shard]  # where each source sent from, in its own rows
  return jax.lax.ragged_all_to_all(out, jnp.zeros((rows, out.shape[1]), out.dtype), received_offsets,
                                   received_sizes, home_offsets, per_shard, axis_name=axes)


def routed_experts(moe, part: partitioning.Partitioning, x, weights, idx, w0, w1, wo):
  """`moe`'s routed experts on `part`'s mesh: [B, S, E] tokens, [B, S, K] weights and expert ids → [B, S, E]."""
  tokens_spec = part.of(("activation_batch", "activation_norm_length", None))
  out_spec = part.of(("activation_batch", "activation_norm_length", "activation_embed"))
  w_in = _without(part.of(("exp", None, "mlp_no_fsdp")), "fsdp")
  w_out = _without(part.of(("exp", "mlp_no_fsdp", None)), "fsdp")
  ep_axes = _axes(w_in[0])
  mlp_axes = _axes(w_in[2])
  ep = 1
  for axis in ep_axes:
    ep *= part.mesh.shape[axis]
  if ep > 1 and not set(ep_axes) <= set(_axes(tokens_spec[0])):
    raise NotImplementedError("expert parallelism with the batch not sharded over the expert axes")
  num_experts, top_k = moe.num_experts, moe.top_k

  def body(x, weights, idx, w0, w1, wo):
    b, s, e = x.shape
    flat = jnp.ravel(idx)
    order = jnp.argsort(flat)
    rows = jnp.take(jnp.repeat(jnp.reshape(x, (b * s, e)), top_k, axis=0), order, axis=0).astype(moe.dtype)
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    lhs, sizes, back = rows, group_sizes, None
    if ep > 1:
      lhs, sizes, back = _route_to_experts(rows, group_sizes, num_experts=num_experts, top_k=top_k, ep=ep,
                                           axes=ep_axes)
    matmul = moe._grouped_matmul  # pylint: disable=protected-access
    up0 = remat.name(matmul(lhs, w0, sizes, "wi"), "mlpwi_0", "moe_mlpwi_0")
    up1 = remat.name(matmul(lhs, w1, sizes, "wi"), "moe_mlpwi_1")
    down = matmul(moe._activation(up0, up1), wo, sizes, "wo")  # pylint: disable=protected-access
    if mlp_axes:
      down = jax.lax.psum(down, mlp_axes)
    down = remat.name(down, "mlpwo", "moe_mlpwo")
    if ep > 1:
      down = _route_back(down, back, rows.shape[0], ep_axes)
    down = jnp.reshape(jnp.take(down, jnp.argsort(order), axis=0), (b * s, top_k, e))
    w = jnp.reshape(weights, (b * s, top_k))
    if moe.float32_weight_sum:
      down, w = down.astype(jnp.float32), w.astype(jnp.float32)
    out = jnp.einsum("BKE,BK -> BE", down, w, precision=moe.precision)
    return jnp.reshape(out, (b, s, e)).astype(moe.dtype)

  routing_spec = part.of(("activation_batch", "activation_norm_length", None))
  mapped = jax.shard_map(body, mesh=part.mesh, in_specs=(tokens_spec, routing_spec, routing_spec, w_in, w_in, w_out),
                         out_specs=out_spec, check_vma=False)
  return mapped(x, weights, idx, w0, w1, wo)
