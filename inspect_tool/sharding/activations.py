"""An ESTIMATE of what one device holds in MaxText's training step besides its state (parameters, optimizer
state) and gradients, calibrated on XLA's own TPU figures for MaxText 0.2.5's `train_compile`.

XLA's peak for the step is code + arguments + temporaries (outputs alias the arguments: the state is donated).
The arguments are the state (`memory`, exact, with TPU tile padding: `tpu_layout`); the temporaries are the
gradients (exact) and what this module estimates, from the config and the per-device layout (`StepLayout`):

  B = per_device_batch_size, S = max_target_length, T = B·S tokens per device, a = bytes of `dtype` (bf16: 2),
  f = 4 (float32), E = emb_dim, V = vocab_size, K = num_experts_per_tok, M = moe_mlp_dim (per tensor shard),
  h = 1 + mtp_num_layers output heads; every array sized as XLA lays it out on TPU (`tpu_layout`).

- bf16 weights: XLA casts each scanned stack's float32 weights to `dtype` once, before the layer loops, and keeps
  the copy for the whole step (the per-device shards: `StepLayout.stack_copies`).
- saved for the backward pass: each scanned layer's input (T·E, `decoder_layer_input`), and what `remat_policy`
  names besides (`SAVED`: q, k, v projections T·H·(dq|dv), out_proj T·E, the MLP's wi_0/wi_1/wo outputs; in a MoE
  layer wi_0 and wo are the expert-sorted rows, R·M and R·E), stacked over the layers.
- the MoE layer whose backward runs: `MOE_E` buffers of R·E and `MOE_M` of R·M, with R the expert-sorted rows:
  T·K, and with expert parallelism MaxText's worst-case ragged all-to-all buffer T·K·min(EP, experts/K); plus the
  layer's routed-expert matrices gathered over fsdp (`StepLayout.layer_gathered`).
- the MTP block (not rematerialised) keeps its MoE buffers (`MTP_E`, `MTP_M` per depth) through the decoder's
  backward; each output head's logits gradient (T·V in `dtype`) is held until the head's weight gradient.
- RoPE: MaxText's yarn embedding computes its table for max_position_embeddings positions (two float32 arrays of
  max_position_embeddings × qk_rope_head_dim/2, laid out 128 lanes wide); two are live whenever a layer runs.
- dot-product attention (`attention=dot_product`): `SCORES` arrays of B·H·S·S_kv in `dtype` per distinct key length
  in the layer's backward (the scores, the probabilities and their gradients); DeepSeek-V4's compressed layers add
  S/r keys per compress ratio r and a sink column. Splash attention's kernel keeps none.
- the loss: the head's logits in float32 and in `dtype` (T·V·(f + a)), and with MTP and B > 1 the MTP head's
  `dtype` logits beside them; the head's kernel gathered (E·V·a); with MTP the RoPE tables' space too, unless the
  float32 logits fit in it (XLA's heap then gives it to them: deepseek3-tiny at 256 tokens on v5e-8 and v5p-8).
- DeepSeek-V4: each saved layer input is mHC's `mhc_expansion_rate` streams wide, one per scanned block of two
  layers and per unrolled hash-routed layer; its compressed attention names no projection for a remat policy.
- compiler scratch: XLA's TPU backend adds scoped HBM to its buffer assignment (`SCOPED`, measured), and
  `temp_size_in_bytes` counts the vector memory's scratch (`VMEM`); the generated code (`CODE`, in proportion to
  the program's parameter arrays: DeepSeek-V4 tiny's 215 against deepseek3-tiny's 51).

The peak is the larger of the two phases: the decoder's backward loop (gradients, bf16 weights, saved tensors,
the MoE layer, held logits gradients, MTP buffers, RoPE tables) and the loss (bf16 weights, saved tensors, MTP
buffers, logits, the gathered head, RoPE tables: the gradients are not allocated yet, so that phase's parts
carry them as a negative part). `tests/test_xla_grid.py` holds the estimate to MaxText 0.2.5's XLA figures on the
grid of `xla_grid.json` (docs/sharding-and-memory.md has the table): within 15 % of XLA's peak on every point; the
family grid (docs/xla-grid.md) reports the points held out of the fit apart.
"""

from __future__ import annotations

import dataclasses
import math

from inspect_tool.configuration import remat_policies
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import tpu_layout

F32 = 4
MOE_E, MOE_M = 5, 3  # R·E and R·M buffers live in a MoE layer's backward (XLA's buffer assignment, v5p)
MTP_E, MTP_M = 1, 2  # the MTP block's MoE buffers held through the decoder's backward, per depth
HELD_LOGITS_TOKENS = 1024  # from this many tokens (at batch 1) XLA holds the logits gradients through the backward
SCORES = 4  # dot-product attention's backward: scores, probabilities and the gradients of both, per key length
CODE_ARRAYS = 51  # parameter arrays of deepseek3-tiny with one MTP layer, the program CODE_BASE was fitted on
VMEM = 48 * 2**20  # vector-memory scratch XLA counts in temp_size_in_bytes on TPU
CODE_BASE, CODE_PER_ROOT_TOKEN = 24 * 2**20, 0.8 * 2**20  # generated code: fit on deepseek3-tiny (0.04-0.07 GiB)
SCOPED_GRADS, SCOPED_GRADS_EP, SCOPED_EP = 0.2, 1.1, 8  # per byte of the stacks' gradients (expert parallelism >= 8)
SCOPED_INPUTS = 2.5  # per byte of the saved layer inputs
SCOPED_SAVED = 1  # ... per byte the remat policy saves beyond the layer inputs


@dataclasses.dataclass(frozen=True)
class StepLayout:
  """Per-device quantities of the sharded tree that the step's temporaries depend on (bytes)."""

  mesh: dict
  tpu: bool
  stack_copies: float  # the scanned stacks' weights in `dtype`
  stack_grads: float  # their gradients (float32)
  layer_gathered: float  # one MoE layer's routed-expert matrices, gathered over fsdp, in `dtype`
  state_padding: float = 0.0  # TPU tile padding of the state (parameters, optimizer state): what XLA adds
  grads_padding: float = 0.0  # ... of the gradients
  arrays: int = CODE_ARRAYS  # parameter arrays: the program's size, which its generated code follows

  @property
  def padding(self) -> float:
    return self.state_padding + self.grads_padding

  def size(self, shape, itemsize: int) -> float:
    """Bytes of a temporary of `shape` as laid out on the target (TPU tiles, row-major; else dense)."""
    return tpu_layout.default_bytes(shape, itemsize) if self.tpu else math.prod(shape) * itemsize


def _gathered(leaf, placement, mesh: dict, layers: int) -> tuple[int, ...]:
  """One layer's shape of a stacked leaf with the fsdp axes gathered (other shardings kept)."""
  dims = []
  for full, entry in zip(leaf.shape, tuple(placement.spec) + (None,) * len(leaf.shape)):
    axes = entry if isinstance(entry, tuple) else (entry,) if entry else ()
    dims.append(full // math.prod(mesh[a] for a in axes if a not in ("fsdp", "fsdp_transpose")))
  if layers in dims:
    dims.remove(layers)
  return tuple(dims)


def layout_of(leaves, plan, cfg, *, optimizer: str | None, tpu: bool = True,
              mu_dtype: str | None = None) -> StepLayout:
  """The `StepLayout` of the Param `leaves` placed by `plan`; `tpu`: size arrays in TPU tiles; `mu_dtype`: adamw's
  first moment's dtype (else the parameter's)."""
  a = _dtype_bytes(cfg.dtype)
  mesh = plan.mesh.shape
  copies = grads = gathered = state_padding = grads_padding = 0.0
  n_moe, arrays = cfg.num_moe_layers, 0
  for leaf in leaves:
    if not leaf.is_param:
      continue
    arrays += 1
    placed = plan.of(leaf)
    shard, item = placed.shard_shape, summary_lib.dtype_bytes(leaf.dtype)
    group, part = summary_lib.group_of(leaf)
    size = tpu_layout.padded_bytes if tpu else (lambda s, i: math.prod(s) * i)
    if tpu:
      pad = size(shard, item) - math.prod(shard) * item
      mu = summary_lib.dtype_bytes(mu_dtype) if optimizer == "adamw" and mu_dtype else item
      state_padding += pad + (0 if optimizer in (None, "sgd") else pad + size(shard, mu) - math.prod(shard) * mu)
      grads_padding += bool(optimizer) * pad
    if group in ("moe stack", "dense stack"):
      copies += size(shard, a)
      grads += size(shard, F32)
    if group == "moe stack" and part == "routed experts":
      gathered += size(_gathered(leaf, placed, mesh, n_moe), a)
  return StepLayout(mesh, tpu, copies, grads, gathered, state_padding, grads_padding, arrays)


@dataclasses.dataclass(frozen=True)
class ActivationEstimate:
  """Bytes per device by part for the phase that peaks; `total` is their sum. An estimate (module docstring)."""

  batch: float
  seq: int
  remat_policy: str
  phase: str  # "backward", "loss" or "step without a loss"
  parts: tuple[tuple[str, float], ...]
  layout: StepLayout | None = None
  with_state: float = 0.0  # of `total`, what is proportional to the per-device state (shrinks as it is sharded)

  @property
  def total(self) -> float:
    return sum(b for _, b in self.parts)

  @property
  def fixed(self) -> float:
    """What more devices of the same mesh shape leave as it is: the tokens' share, the scratch, the code."""
    return self.total - self.with_state

  def to_dict(self) -> dict:
    return {"estimate": True, "per_device_batch_size": self.batch, "max_target_length": self.seq,
            "remat_policy": self.remat_policy, "peak_phase": self.phase, "parts": dict(self.parts),
            "total_bytes": self.total, "with_state_bytes": self.with_state}


def _dtype_bytes(name) -> int:
  # lazy: NumPy, ~0.05 s to import; ml_dtypes (and NumPy), ~0.05 s to import: `hf --path` loads this module without it
  import numpy as np  # pylint: disable=import-outside-toplevel
  import ml_dtypes  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import  (registers bfloat16 with numpy)

  return np.dtype(str(name)).itemsize


def moe_rows(cfg, mesh: dict, tokens: float) -> int:
  """Expert-sorted rows per device: T·K, times MaxText's worst-case ragged buffer factor with expert parallelism."""
  ep = mesh.get("expert", 1)
  factor = min(ep, cfg.num_experts / cfg.num_experts_per_tok) if ep > 1 else 1
  return int(tokens * cfg.num_experts_per_tok * factor)


def saved_names(cfg, policy: str) -> frozenset[str]:
  """The checkpoint names `remat_policy` keeps on the device (`model.remat`; offloaded ones go to host memory)."""
  if policy == "custom":
    return frozenset(remat_policies.custom_names(cfg)[0])
  if policy == "none" or policy not in remat_policies.POLICIES:  # nothing rematerialised: an upper bound
    return frozenset(remat_policies.CUSTOM_NAMES)
  return frozenset(remat_policies.SAVED.get(policy, ()))


def saved(cfg, layout: StepLayout, batch: float, seq: int, policy: str) -> float:
  """Bytes the scanned layers save for the backward pass under `policy` (stacked over the layers): each layer's
  input, and the named activations the policy keeps (MaxText's names, `model.remat`): the q, k, v projections
  T·H·(dq|dv), out_proj T·E, splash attention's `context` residuals, the MLPs' `mlpwi_0` / `mlpwi_1` outputs (a
  dense layer's of width mlp_dim, a MoE layer's shared experts'), the routed experts' `mlpwi_0` R·M and `mlpwo` R·E
  in expert-sorted rows, and `custom`'s MLA latents. A value no step of the backward needs is not kept, named or not
  (an MLP's output, which goes into the residual sum)."""
  a, size, mesh = _dtype_bytes(cfg.dtype), layout.size, layout.mesh
  b, e, h, hkv = max(1, round(batch)), cfg.emb_dim, cfg.num_query_heads, cfg.num_query_heads
  dq, dv, streams = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, 1
  if str(cfg.decoder_block) == "deepseek4":  # heads of head_dim, one shared key-value head; mHC's residual streams
    dq = dv = cfg.head_dim
    hkv, streams = cfg.num_kv_heads, max(1, int(cfg.mhc_expansion_rate))
  names = saved_names(cfg, policy)
  if streams > 1:  # DeepSeek-V4's compressed attention names no projection
    names -= {"out_proj", "query_proj", "key_proj", "value_proj", "attention_out", "context", "query_wa_proj", "mla_q",
              "kv_wa_proj", "mla_kv"}
  has = lambda *ns: sum(n in names for n in ns)  # pylint: disable=unnecessary-lambda-assignment
  rows = moe_rows(cfg, mesh, batch * seq)
  m = cfg.moe_mlp_dim // mesh.get("tensor", 1)
  shared = cfg.shared_experts * cfg.moe_mlp_dim // mesh.get("tensor", 1)
  splash = layout.tpu and str(cfg.attention) in ("flash", "autoselected") and seq >= 128  # its residuals: `context`
  total = 0.0
  if streams > 1:  # DeepSeek-V4: one input per scanned block of two layers and per unrolled hash layer, mHC's
    hashed = int(cfg.first_num_hash_layers)  # streams wide
    total += size(((cfg.num_decoder_layers - hashed) // 2 + hashed, b * streams, seq, e), a)
  for n, moe in ((cfg.first_num_dense_layers, False), (cfg.num_moe_layers, True)):
    if not n:
      continue
    total += size((n, b, seq, e), a) * ((streams == 1) + has("out_proj"))
    total += size((n, b, seq, h, dq), a) * has("query_proj") + size((n, b, seq, hkv, dq), a) * has("key_proj")
    total += size((n, b, seq, hkv, dv), a) * has("value_proj")
    total += size((n, b, seq, h, dv), a) * (has("attention_out") + ("context" in names and splash))
    total += size((n, b, seq, cfg.q_lora_rank), a) * has("query_wa_proj", "mla_q") if cfg.q_lora_rank else 0
    total += size((n, b, seq, cfg.kv_lora_rank + cfg.qk_rope_head_dim), a) * has("kv_wa_proj")
    total += size((n, b, seq, cfg.kv_lora_rank), a) * has("mla_kv")
    width = shared if moe else cfg.mlp_dim
    if width:  # an MLP's output (`mlpwo`) goes into the residual sum: no step of the backward keeps it
      total += size((n, b, seq, width), a) * has("mlpwi_0", "mlpwi_1")
    if moe:
      total += size((n, rows, m), a) * (bool(has("mlpwi_0", "moe_mlpwi_0")) + has("moe_mlpwi_1"))
      total += size((n, rows, e), a) * bool(has("mlpwo", "moe_mlpwo"))
  return total


def attention_scores(cfg, layout: StepLayout, batch: float, seq: int, a: int) -> float:
  """One of dot-product attention's score arrays (B·H·S·S_kv in `dtype`) per distinct key length S_kv of the
  layers: S, or for DeepSeek-V4 S + S/r + 1 per compress ratio r (S + 1 uncompressed: the sink takes a column)."""
  if str(cfg.attention) != "dot_product":
    return 0.0
  heads = max(1, cfg.num_query_heads // layout.mesh.get("tensor", 1))
  ratios = {int(r) for r in cfg.compress_ratios} if str(cfg.decoder_block) == "deepseek4" else set()
  lengths = [seq + (seq // r if r else 0) + 1 for r in sorted(ratios)] or [seq]
  return sum(layout.size((int(math.ceil(batch)), heads, seq, n), a) for n in lengths)


def rope_tables(cfg, layout: StepLayout) -> float:
  """MaxText's yarn tables: two float32 arrays of max_position_embeddings × qk_rope_head_dim/2, 128 lanes wide."""
  if str(cfg.rope_type) != "yarn":
    return 0.0
  half = cfg.qk_rope_head_dim // 2
  lanes = -(-half // 128) * 128 if layout.tpu else half
  return 2.0 * cfg.max_position_embeddings * lanes * F32


def estimate(cfg, layout: StepLayout, *, gradients: float = 0.0, batch: float | None = None,
             seq: int | None = None, remat_policy: str | None = None, room: float | None = None) -> ActivationEstimate:
  """The estimate for `cfg` on `layout` (batch, seq and policy default to the config's keys); `gradients`: the
  exact gradient bytes, which the loss phase, before they exist, subtracts; `room`: what the device leaves beside
  the exact state and gradients, past which XLA rematerialises what it can of the loss."""
  batch = float(cfg.per_device_batch_size if batch is None else batch)
  seq = int(cfg.max_target_length if seq is None else seq)
  policy = str(remat_policy if remat_policy is not None else getattr(cfg, "remat_policy", "full"))
  if not has_loss(cfg):  # nothing to differentiate: XLA keeps neither the forward, nor the backward, nor gradients
    parts = [("gradients (none: the step has no loss term, its zero gradients are folded away)", -gradients),
             ("generated code", CODE_BASE)] + ([("TPU tile padding of the state", layout.state_padding)]
                                               if layout.state_padding else [])
    return ActivationEstimate(batch, seq, policy, "step without a loss", _whole(parts), layout,
                              round(layout.state_padding - gradients))
  a, size, mesh = _dtype_bytes(cfg.dtype), layout.size, layout.mesh
  tokens, e, v = batch * seq, cfg.emb_dim, cfg.vocab_size
  depths = int(cfg.mtp_num_layers)
  rows = moe_rows(cfg, mesh, tokens) if cfg.num_moe_layers else 0
  m = cfg.moe_mlp_dim // mesh.get("tensor", 1)
  common = [("weights cast to " + str(cfg.dtype) + " (the scanned stacks, kept for the step)", layout.stack_copies),
            (f"saved for the backward pass (remat_policy={policy})", saved(cfg, layout, batch, seq, policy))]
  if layout.tpu and policy != "full":
    common.append(("scoped HBM: what the policy saves, a second time",
                   SCOPED_SAVED * (common[-1][1] - saved(cfg, layout, batch, seq, "full"))))
  if depths and rows:
    common.append(("MTP block's MoE buffers (held through the decoder's backward)",
                   depths * (MTP_E * size((rows, e), a) + MTP_M * size((rows, m), a))))
  rope = ("RoPE tables (yarn, max_position_embeddings positions)", rope_tables(cfg, layout))
  fixed = [("vector-memory scratch", VMEM if layout.tpu else 0.0),
           ("generated code", code_size(layout, tokens))]
  if layout.padding:
    fixed.append(("TPU tile padding of the state and gradients", layout.padding))
  backward = common + [
      ("MoE layer in its backward (expert-sorted buffers, gathered experts)",
       (MOE_E * size((rows, e), a) + MOE_M * size((rows, m), a) + layout.layer_gathered) if rows else 0.0),
      _held(cfg, layout, batch, tokens, depths, a), rope,
      ("dot-product attention's score arrays in the backward", SCORES * attention_scores(cfg, layout, batch, seq, a)),
      ("scoped HBM of the layer loop", _loop_scoped(cfg, layout, batch, seq) if layout.tpu else 0.0)]
  heads = main_loss(cfg) + depths  # the output heads whose logits the loss holds
  extra = size((tokens, v), a) if heads > 1 and batch > 1 else 0.0
  logits = (size((tokens, v), F32) + size((tokens, v), a)) if heads else 0.0
  rope_below = size((tokens, v), F32) > rope[1]  # else the logits take the tables' freed space in XLA's heap

  def loss_parts(second):
    return common + [
        (f"logits of the loss (float32 and {cfg.dtype})", logits + second),
        ("output head's kernel gathered", size((e, v), a) if heads else 0.0),
        ("gradients (not allocated yet at the loss)", -gradients)] + ([rope] if depths and rope_below else [])

  loss = loss_parts(extra)
  if extra and room is not None and sum(b for _, b in loss + fixed) > room:
    loss = loss_parts(0.0)  # XLA rematerialises the second bf16 copy to fit the device (v5e-1, 8 × 2048 tokens)
  state = layout.stack_copies + layout.padding
  if sum(b for _, b in backward) >= sum(b for _, b in loss):
    state += _scoped_grads(layout) if layout.tpu else 0.0
    return ActivationEstimate(batch, seq, policy, "backward", _whole(backward + fixed), layout, round(state))
  return ActivationEstimate(batch, seq, policy, "loss", _whole(loss + fixed), layout, round(state - gradients))


def code_size(layout: StepLayout, tokens: float) -> float:
  """XLA's generated code: grows with the root of the tokens (fitted on deepseek3-tiny), and in proportion to the
  program, counted in parameter arrays (DeepSeek-V4 tiny's 215 against deepseek3-tiny's 51: 66-219 MiB measured)."""
  return (CODE_BASE + CODE_PER_ROOT_TOKEN * math.sqrt(tokens)) * layout.arrays / CODE_ARRAYS


def has_loss(cfg) -> bool:
  """Whether MaxText's step has a loss term at all: the main loss, an MTP depth or the MoE load-balance loss (an
  indexer's dense warm-up of a model without MTP or load balancing has none: deepseek-custom, V3.2 without MTP)."""
  return bool(main_loss(cfg) or int(cfg.mtp_num_layers) or (cfg.num_moe_layers
                                                           and float(cfg.load_balance_loss_weight) > 0))


def main_loss(cfg) -> int:
  """1 when MaxText's step computes the main loss, 0 in an indexer's dense warm-up (`use_indexer`,
  `indexer_sparse_training=false`), where it leaves it out (`xla_compile.step`)."""
  return int(not (bool(cfg.use_indexer) and not bool(cfg.indexer_sparse_training)))


def _whole(parts) -> tuple[tuple[str, float], ...]:
  """The parts in whole bytes."""
  return tuple((name, float(round(b))) for name, b in parts)


def _loop_scoped(cfg, layout: StepLayout, batch: float, seq: int) -> float:
  """Scoped HBM XLA's TPU backend adds to the backward layer loop, beyond its buffer assignment (measured)."""
  return _scoped_grads(layout) + SCOPED_INPUTS * saved(cfg, layout, batch, seq, "full")


def _scoped_grads(layout: StepLayout) -> float:
  """The share of the loop's scoped HBM that follows the stacks' gradients (more with expert parallelism >= 8)."""
  per_grad = SCOPED_GRADS_EP if layout.mesh.get("expert", 1) >= SCOPED_EP else SCOPED_GRADS
  return per_grad * layout.stack_grads


def _held(cfg, layout: StepLayout, batch: float, tokens: float, depths: int, a: int) -> tuple[str, float]:
  """What each output head leaves for the decoder's backward: its logits gradient (T·V) when XLA defers the head's
  weight gradient past the layer loop (seen with per_device_batch_size=1 and 1024 tokens or more), else that weight
  gradient (E·V, gathered)."""
  heads, v = main_loss(cfg) + depths, cfg.vocab_size
  if not heads:  # an indexer's dense warm-up without MTP: no output head enters the loss
    return "output heads' gradients (none: no head in the loss)", 0.0
  if batch == 1 and tokens >= HELD_LOGITS_TOKENS:
    return f"logits gradients held for {heads} output head(s)", heads * layout.size((tokens, v), a)
  return f"output head kernel gradients ({heads} head(s), gathered)", heads * layout.size((cfg.emb_dim, v), a)


def describe(est: ActivationEstimate) -> str:
  """One line: the figure, labelled an estimate, with what it assumed."""
  batch = int(est.batch) if float(est.batch).is_integer() else est.batch
  return (f"XLA's temporaries beyond the gradients, and its code (estimate, per_device_batch_size={batch}, "
          f"max_target_length={est.seq}, remat_policy={est.remat_policy}, peak in the {est.phase}): "
          f"{summary_lib.human_bytes(est.total)}")
