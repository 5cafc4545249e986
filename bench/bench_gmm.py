"""Benchmark of the FP8 grouped matmul (`quant.gmm_fp8.quantized_gmm`) against bf16 `jax.lax.ragged_dot`.

Routed-expert shapes: rows = tokens * top-k sorted by expert, K = emb (E), N = expert mlp width (F), G experts;
group sizes are a seeded random routing. Every op is jitted; times are the median of --repeats runs after
--warmup runs. Runs on JAX's default backend (CPU or an accelerator).

  python bench/bench_gmm.py                 # default sizes
  python bench/bench_gmm.py --grad          # also forward+backward
  python bench/bench_gmm.py --sizes 4096x8:256:512:64 --repeats 5 --strategy batched
"""

import argparse
import pathlib
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import qwix

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from quant import gmm_fp8  # noqa: E402  pylint: disable=wrong-import-position

DEFAULT_SIZES = ("4096x8:64:64:16", "4096x8:64:64:64", "4096x8:256:512:16")
FP8_RULE = qwix.QtRule(weight_qtype=jnp.float8_e4m3fn, act_qtype=jnp.float8_e4m3fn, bwd_qtype=jnp.float8_e5m2)


def _parse_size(text: str) -> tuple[int, int, int, int]:
  """'<tokens>x<topk>:<E>:<F>:<G>' -> (rows, K, N, G)."""
  try:
    tokens, emb, mlp, groups = text.split(":")
    count, topk = tokens.split("x")
    return int(count) * int(topk), int(emb), int(mlp), int(groups)
  except ValueError as error:
    raise argparse.ArgumentTypeError(f"size {text!r} is invalid; accepted: <tokens>x<topk>:<E>:<F>:<G>") from error


def _median_seconds(fn, args, warmup: int, repeats: int) -> float:
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _ops(grad: bool, strategy: str):
  """Jitted callables keyed by name: fp8 quantized gmm and bf16 ragged_dot (forward, optionally fwd+bwd)."""
  ops = {
      "fp8 quantized_gmm": jax.jit(lambda l, r, g: gmm_fp8.quantized_gmm(l, r, g, FP8_RULE, strategy=strategy)),
      "bf16 ragged_dot": jax.jit(lambda l, r, g: jax.lax.ragged_dot(l, r, g, preferred_element_type=jnp.bfloat16)),
  }
  if grad:
    def fwd_bwd(fn):
      return jax.jit(jax.grad(lambda l, r, g: jnp.sum(fn(l, r, g).astype(jnp.float32)), (0, 1)))
    ops["fp8 quantized_gmm fwd+bwd"] = fwd_bwd(
        lambda l, r, g: gmm_fp8.quantized_gmm(l, r, g, FP8_RULE, strategy=strategy))
    ops["bf16 ragged_dot fwd+bwd"] = fwd_bwd(
        lambda l, r, g: jax.lax.ragged_dot(l, r, g, preferred_element_type=jnp.bfloat16))
  return ops


def run(sizes, warmup: int, repeats: int, grad: bool, seed: int, strategy: str = "loop") -> None:
  backend = jax.default_backend()
  print(f"backend: {backend} ({jax.devices()[0].device_kind}), jax {jax.__version__}, "
        f"gmm strategy: {strategy}, tile rows: {gmm_fp8.DEFAULT_TILE_ROWS}")
  print(f"median of {repeats} runs after {warmup} warmup; ratio = ragged_dot time / fp8 time")
  rng = np.random.default_rng(seed)
  for rows, emb, mlp, num_groups in sizes:
    lhs = jnp.asarray(rng.normal(size=(rows, emb)), jnp.bfloat16)
    rhs = jnp.asarray(rng.normal(size=(num_groups, emb, mlp)) / np.sqrt(emb), jnp.bfloat16)
    groups = jnp.asarray(np.bincount(rng.integers(0, num_groups, rows), minlength=num_groups), jnp.int32)
    ops = _ops(grad, strategy)
    times = {name: _median_seconds(fn, (lhs, rhs, groups), warmup, repeats) for name, fn in ops.items()}
    exact = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), groups,
                               precision=jax.lax.Precision.HIGHEST)
    fp8_out = ops["fp8 quantized_gmm"](lhs, rhs, groups).astype(jnp.float32)
    rel = float(jnp.linalg.norm(fp8_out - exact) / jnp.linalg.norm(exact))
    print(f"rows={rows} K(E)={emb} N(F)={mlp} G={num_groups}: fp8 rel. error vs float {rel:.4f}")
    for kind in ("", " fwd+bwd"):
      if f"fp8 quantized_gmm{kind}" not in times:
        continue
      ours, theirs = times[f"fp8 quantized_gmm{kind}"], times[f"bf16 ragged_dot{kind}"]
      print(f"  {kind.strip() or 'fwd':8s} fp8 quantized_gmm {ours * 1e3:9.2f} ms | bf16 ragged_dot "
            f"{theirs * 1e3:9.2f} ms | ratio {theirs / ours:6.2f}x")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--sizes", nargs="+", type=_parse_size, default=None,
                      help=f"<tokens>x<topk>:<E>:<F>:<G> (default: {' '.join(DEFAULT_SIZES)})")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--grad", action="store_true", help="also time forward+backward (sum of outputs)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--strategy", choices=gmm_fp8.STRATEGIES, default="loop", help="work-item execution")
  args = parser.parse_args(argv)
  sizes = args.sizes or [_parse_size(s) for s in DEFAULT_SIZES]
  run(sizes, args.warmup, args.repeats, args.grad, args.seed, args.strategy)


if __name__ == "__main__":
  main()
