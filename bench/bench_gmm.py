"""Grouped-matmul throughput on one chip: ours (bf16 and fp8_full) beside MaxText's kernel, ragged_dot and a dense
matmul of the same FLOPs, as TFLOP/s and as ratios to MaxText's kernel.

Shapes: DeepSeek-V3's routed experts (emb 7168, moe mlp 2048) with `--experts` experts on the chip (32: 256 experts
under expert parallelism 8), `tokens x top-8` rows routed to them by a seeded uniform routing (group sizes from
`jax.random`), wi ([M, 7168] x [G, 7168, 2048]) and wo ([M, 2048] x [G, 2048, 7168]). Every operand is made on the
device (bf16), so a 16 GiB chip and a small host suffice. TFLOP/s counts 2*M*K*N per matmul, three matmuls with
`--grad` (forward + backward). Times: median of `--repeats` after `--warmup`, each call jitted and awaited.

Cases per shape:
* dense: one bf16 [M, K] x [K, N] matmul (`jnp.dot`), the chip's rate at these FLOPs;
* maxtext: MaxText 0.2.5's own Megablox kernel at its default tiles (512, 1024, 1024), loaded from its file
  (`--maxtext PATH` to maxtext/kernels/megablox/backend.py, or MAXTEXT_MEGABLOX); without it JAX's Megablox at
  those tiles (`gmm_backend=megablox`), which MaxText's is derived from. bf16: its fp8_full path does not compile
  on v5e (MosaicError: infer-vector-layout: unsupported shape cast), and the forward + backward is its
  custom VJP's three kernels (gmm, gmm with the weight transposed, tgmm);
* ragged_dot: `jax.lax.ragged_dot` (bf16; its transpose rule with --grad);
* ours bf16, ours fp8_full: `quant.gmm.fp8.quantized_gmm` as the model runs it (`gmm_backend` auto: our Pallas kernel
  on TPU), fp8_full with MaxText's rule (e4m3 weights per column and activations per row, quantized on the fly,
  e5m2 gradients), the quantization included in the time;
* with `--parts`, ours fp8_full's quantization alone (the operands', and with --grad the gradients'), without the
  matmuls: its TFLOP/s and ratio columns count the FLOPs it does not do; its milliseconds are its share of the time.

`--sweep` times our kernel alone (bf16 and fp8 operands; forward, dlhs and drhs kernels) at a set of tilings and row
blocks, the measurements behind `quant.gmm.tiles.auto`. Off TPU the Pallas kernels run in interpret mode: `--tiny` is a
smoke run of the script's structure (reference kernel for ours, no MaxText kernel), not a measurement.

  python bench/bench_gmm.py [--grad] [--tokens 4096 8192] [--experts 32] [--maxtext PATH]
  python bench/bench_gmm.py --sweep --tokens 8192
  python bench/bench_gmm.py --tiny
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import os
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import qwix

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from quant import fp8  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import backends as gmm_backends  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import fp8 as gmm_fp8  # noqa: E402  pylint: disable=wrong-import-position
from quant.gmm import kernel  # noqa: E402  pylint: disable=wrong-import-position

FP8_RULE = qwix.QtRule(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)
EMB, MLP, TOP_K = 7168, 2048, 8  # DeepSeek-V3: emb_dim, moe_mlp_dim, experts per token
MAXTEXT_TILES = (512, 1024, 1024)
SWEEP = [kernel.Tiling(*t) for t in ((512, 1024, 1024), (512, 2048, 1024), (512, 1024, 2048), (1024, 1024, 1024),
                                     (256, 1024, 1024), (512, 2048, 2048), (1024, 1024, 2048), (1024, 2048, 1024),
                                     (256, 2048, 2048), (1024, 512, 1024))]


@dataclasses.dataclass
class Case:
  name: str
  fn: object
  args: tuple
  flops: float
  compiled: object = None
  error: str = ""


def _seconds(compiled, args, warmup: int, repeats: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _compile_all(cases: list[Case], workers: int) -> None:
  """Compiles every case ahead of time, several at once (XLA compiles outside the GIL)."""
  def one(case):
    try:
      case.compiled = jax.jit(case.fn).lower(*case.args).compile()
    except Exception as e:  # pylint: disable=broad-except  (a kernel that does not compile is a result)
      case.error = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    list(pool.map(one, cases))


def load_maxtext(path: str | None):
  """MaxText's Megablox kernel module from its file, or None (then JAX's Megablox stands in for it)."""
  path = path or os.environ.get("MAXTEXT_MEGABLOX")
  if not path or not os.path.isfile(path):
    return None
  spec = importlib.util.spec_from_file_location("maxtext_megablox_backend", path)
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
  except Exception as e:  # pylint: disable=broad-except
    print(f"MaxText's kernel did not import from {path} ({type(e).__name__}: {e}); JAX's Megablox stands in")
    return None
  return module


def _peer_ops(module, interpret: bool):
  """MaxText's kernel (or JAX's Megablox) as forward and forward + backward functions, bf16, at MaxText's tiles."""
  if module is None:
    def fwd(lhs, rhs, groups):
      return gmm_backends.matmul("megablox", lhs, rhs, groups, tile_rows=0, strategy="loop",
                                 tiling=kernel.Tiling(*MAXTEXT_TILES), out_dtype=jnp.bfloat16)

    def dlhs(grad, rhs, groups):
      return gmm_backends.matmul("megablox", grad, rhs, groups, tile_rows=0, strategy="loop",
                                 tiling=kernel.Tiling(*MAXTEXT_TILES), transpose_rhs=True, out_dtype=jnp.bfloat16)

    def drhs(lhs, grad, groups):
      return gmm_backends.outer("megablox", lhs, grad, groups, tile_rows=0, strategy="loop",
                                tiling=kernel.Tiling(*MAXTEXT_TILES), out_dtype=jnp.bfloat16)
  else:
    def fwd(lhs, rhs, groups):
      return module.gmm(lhs, rhs, groups, jnp.bfloat16, MAXTEXT_TILES, interpret=interpret)

    def dlhs(grad, rhs, groups):
      return module.gmm(grad, rhs, groups, jnp.bfloat16, MAXTEXT_TILES, transpose_rhs=True, interpret=interpret)

    def drhs(lhs, grad, groups):
      return module.tgmm(lhs.swapaxes(0, 1), grad, groups, jnp.bfloat16, MAXTEXT_TILES, interpret=interpret)

  def fwd_bwd(lhs, rhs, groups, grad):
    return fwd(lhs, rhs, groups), dlhs(grad, rhs, groups), drhs(lhs, grad, groups)
  return fwd, fwd_bwd


def _with_vjp(forward, grad: bool):
  """`forward(lhs, rhs, groups)`, or with `grad` its output and both operands' gradients for the cotangent `cot`."""
  if not grad:
    return forward

  def fwd_bwd(lhs, rhs, groups, cot):
    out, vjp = jax.vjp(lambda l, r: forward(l, r, groups), lhs, rhs)
    return (out, *vjp(cot))
  return fwd_bwd


def _ours(rule, grad: bool):
  return _with_vjp(lambda lhs, rhs, groups: gmm_fp8.quantized_gmm(lhs, rhs, groups, rule, jnp.bfloat16,
                                                                  backend=gmm_backends.resolve("auto")), grad)


def _zeros_past_groups(x, groups):
  """`x` [M, N] with zeros in the rows past the groups (the masking pass the op ran before zero_tail)."""
  return jnp.where((jnp.arange(x.shape[0]) < jnp.sum(groups))[:, None], x, jnp.zeros((), x.dtype))


def _ours_masked(rule, grad: bool):
  """Ours with a masking pass over the output after the op, as the op ran before the kernel stored the zeros past
  the groups itself (`--masked`: both in one run, on the same chip)."""
  def op(lhs, rhs, groups):
    out = gmm_fp8.quantized_gmm(lhs, rhs, groups, rule, jnp.bfloat16, backend=gmm_backends.resolve("auto"))
    return _zeros_past_groups(out, groups)
  return _with_vjp(op, grad)


def _quantization_only(rule, grad: bool):
  """The quantizations of ours fp8_full alone (`--parts`), as `quant.gmm.fp8` does them: the weight per column and
  the rows per row in the forward; with `grad` also the two gradients' (per row for dlhs, per column for drhs). The
  matmuls left out, this is the time the quantization adds to the kernel's."""
  def forward(lhs, rhs):
    w, w_scale = fp8.quantize(rhs, rule.weight_qtype, [2], scale_dtype=jnp.float32)
    a, a_scale = fp8.quantize(lhs, rule.act_qtype, [0], scale_dtype=jnp.float32)
    return w, w_scale, a, a_scale

  if not grad:
    return lambda lhs, rhs, groups: forward(lhs, rhs)

  def fwd_bwd(lhs, rhs, groups, cot):
    w, w_scale, a, a_scale = forward(lhs, rhs)
    cot = _zeros_past_groups(cot, groups)
    dl = fp8.quantize(cot * w_scale.astype(cot.dtype).reshape(1, -1), rule.bwd_qtype, [0], scale_dtype=jnp.float32)
    dr = fp8.quantize(cot * a_scale.astype(cot.dtype), rule.bwd_qtype, [1], scale_dtype=jnp.float32)
    return w, w_scale, a, a_scale, dl, dr
  return fwd_bwd


def _ragged(grad: bool):
  return _with_vjp(lambda lhs, rhs, groups: jax.lax.ragged_dot(lhs, rhs, groups, preferred_element_type=jnp.bfloat16),
                   grad)


def _data(key, rows: int, k: int, n: int, experts: int):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  lhs = jax.random.normal(k1, (rows, k), jnp.bfloat16)
  rhs = (jax.random.normal(k2, (experts, k, n), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
  groups = jnp.bincount(jax.random.randint(k3, (rows,), 0, experts), length=experts).astype(jnp.int32)
  cot = jax.random.normal(k4, (rows, n), jnp.bfloat16)
  return lhs, rhs, groups, cot


def compare(args, shapes, maxtext) -> None:
  """The comparison table, per shape: every case's ms, TFLOP/s and ratio to MaxText's kernel."""
  interpret = jax.default_backend() != "tpu"
  peer_name = "maxtext (its file)" if maxtext is not None else "maxtext (JAX Megablox, its tiles)"
  peer_fwd, peer_fwd_bwd = _peer_ops(maxtext, interpret)
  key = jax.random.key(args.seed)
  for tokens, name, rows, k, n in shapes:
    key, sub = jax.random.split(key)
    lhs, rhs, groups, cot = _data(sub, rows, k, n, args.experts)
    flops = 2 * rows * k * n * (3 if args.grad else 1)
    dense_w = rhs[0]
    cases = [Case("dense bf16 matmul", (lambda a, b, c: (jnp.dot(a, b), jnp.dot(c, b.T), jnp.dot(a.T, c)))
                  if args.grad else (lambda a, b: jnp.dot(a, b)),
                  (lhs, dense_w, cot) if args.grad else (lhs, dense_w), flops)]
    if not args.tiny or not interpret:
      cases.append(Case(peer_name, peer_fwd_bwd if args.grad else peer_fwd,
                        (lhs, rhs, groups, cot) if args.grad else (lhs, rhs, groups), flops))
    cases.append(Case("ragged_dot bf16", _ragged(args.grad), (lhs, rhs, groups, cot) if args.grad else
                      (lhs, rhs, groups), flops))
    for label, rule in (("ours bf16", None), ("ours fp8_full", FP8_RULE)):
      cases.append(Case(label, _ours(rule, args.grad), (lhs, rhs, groups, cot) if args.grad else (lhs, rhs, groups),
                        flops))
      if args.masked:
        cases.append(Case(f"{label}, masked as before", _ours_masked(rule, args.grad),
                          (lhs, rhs, groups, cot) if args.grad else (lhs, rhs, groups), flops))
    if args.parts:
      cases.append(Case("ours fp8_full, quantization alone", _quantization_only(FP8_RULE, args.grad),
                        (lhs, rhs, groups, cot) if args.grad else (lhs, rhs, groups), flops))
    _compile_all(cases, args.workers)
    print(f"\ntokens {tokens} {name}: M {rows}, K {k}, N {n}, {args.experts} experts, "
          f"{'forward + backward' if args.grad else 'forward'}", flush=True)
    times = {}
    for case in cases:
      if case.compiled is None:
        print(f"  {case.name:36s} does not compile: {case.error}")
        continue
      times[case.name] = _seconds(case.compiled, case.args, args.warmup, args.repeats)
    peer = times.get(peer_name)
    for case in cases:
      if case.name in times:
        seconds = times[case.name]
        ratio = f"{peer / seconds:6.2f}x" if peer else "   n/a"
        print(f"  {case.name:36s} {seconds * 1e3:9.3f} ms {case.flops / seconds / 1e12:8.1f} TFLOP/s {ratio}",
              flush=True)


def sweep(args, shapes) -> None:
  """Our kernel alone at each tiling and row block: forward, dlhs and drhs, bf16 and fp8 operands."""
  interpret = jax.default_backend() != "tpu"
  key = jax.random.key(args.seed)
  for tokens, name, rows, k, n in shapes:
    key, sub = jax.random.split(key)
    lhs, rhs, groups, cot = _data(sub, rows, k, n, args.experts)
    operands = {"bf16": (lhs, rhs, cot), "fp8": tuple(x.astype(jnp.float8_e4m3fn) for x in (lhs, rhs, cot))}
    cases = []
    for dtype, (a, w, c) in operands.items():
      for tiling in SWEEP:
        for sub_rows in sorted({128, tiling.tm}):
          tag = f"{dtype} {tiling.tm}x{tiling.tk}x{tiling.tn} rows {sub_rows}"
          fit = tiling.fit(rows, k, n, kernel.row_multiple(a.dtype))
          fwd = lambda x, y, g, t=fit, s=sub_rows: kernel.gmm(x, y, g, out_dtype=jnp.bfloat16, tiling=t,
                                                             sub_rows=s, interpret=interpret)
          if "fwd" in args.kinds:
            cases.append(Case(f"fwd  {tag}", fwd, (a, w, groups), 2 * rows * k * n))
          fit_t = tiling.fit(rows, n, k, kernel.row_multiple(a.dtype))
          dl = lambda x, y, g, t=fit_t, s=sub_rows: kernel.gmm(x, y, g, out_dtype=jnp.bfloat16, tiling=t,
                                                              transpose_rhs=True, sub_rows=s, interpret=interpret)
          if "dlhs" in args.kinds:
            cases.append(Case(f"dlhs {tag}", dl, (c, w, groups), 2 * rows * k * n))
          dr = lambda x, y, g, t=fit, s=sub_rows: kernel.tgmm(x, y, g, out_dtype=jnp.bfloat16, tiling=t,
                                                             sub_rows=s, interpret=interpret)
          if "drhs" in args.kinds:
            cases.append(Case(f"drhs {tag}", dr, (a, c, groups), 2 * rows * k * n))
    _compile_all(cases, args.workers)
    print(f"\nsweep, tokens {tokens} {name}: M {rows}, K {k}, N {n}, {args.experts} experts", flush=True)
    best = {}
    for case in cases:
      if case.compiled is None:
        print(f"  {case.name:40s} does not compile: {case.error}")
        continue
      seconds = _seconds(case.compiled, case.args, args.warmup, args.repeats)
      tflops = case.flops / seconds / 1e12
      print(f"  {case.name:40s} {seconds * 1e3:9.3f} ms {tflops:8.1f} TFLOP/s", flush=True)
      kind = case.name[:4] + case.name.split()[1]
      if tflops > best.get(kind, (0, ""))[0]:
        best[kind] = (tflops, case.name)
    for kind, (tflops, case_name) in sorted(best.items()):
      print(f"  best {kind:10s} {case_name:40s} {tflops:8.1f} TFLOP/s")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--tokens", nargs="+", type=int, default=[4096, 8192])
  parser.add_argument("--experts", type=int, default=32, help="experts on the chip (default 32: 256 under EP 8)")
  parser.add_argument("--matmuls", nargs="+", choices=("wi", "wo"), default=["wi", "wo"])
  parser.add_argument("--grad", action="store_true", help="forward + backward (3 matmuls)")
  parser.add_argument("--masked", action="store_true",
                      help="also ours with a masking pass over the output, as the op ran before zero_tail")
  parser.add_argument("--parts", action="store_true",
                      help="also the quantization of ours fp8_full alone, without its matmuls (its share of the time)")
  parser.add_argument("--sweep", action="store_true", help="our kernel alone at each tiling (tiles.auto)")
  parser.add_argument("--kinds", nargs="+", choices=("fwd", "dlhs", "drhs"), default=["fwd", "dlhs", "drhs"],
                      help="--sweep: the kernels to time")
  parser.add_argument("--maxtext", default=None, help="MaxText's maxtext/kernels/megablox/backend.py")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=7)
  parser.add_argument("--workers", type=int, default=8, help="compiles at once")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tiny", action="store_true", help="smoke run: shapes / 32, 4 experts, 256 tokens, 1 repeat")
  args = parser.parse_args(argv)
  scale = 1
  if args.tiny:
    scale, args.experts, args.tokens, args.warmup, args.repeats = 32, 4, [256], 1, 1
  device = jax.devices()[0]
  print(f"device: {device.platform} ({device.device_kind}), jax {jax.__version__}; median of {args.repeats} after "
        f"{args.warmup} warmup; ours: gmm_backend=auto -> {gmm_backends.resolve('auto')}, tiles.auto per shape")
  emb, mlp = EMB // scale, MLP // scale
  shapes = [(t, mm, t * TOP_K, *((emb, mlp) if mm == "wi" else (mlp, emb))) for t in args.tokens for mm in args.matmuls]
  if args.sweep:
    sweep(args, shapes)
  else:
    compare(args, shapes, load_maxtext(args.maxtext))


if __name__ == "__main__":
  main()
