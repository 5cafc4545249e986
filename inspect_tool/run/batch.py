"""Input batches for `forward` and export validation: token files checked against the model config.

A batch is MaxText's training batch: tokens (B, S) int32, positions `arange(S)` per row, segment ids ones,
targets = tokens shifted left by one (the last target wraps around to the first token, as in the reference
golden data) unless given, target mask ones.
"""

from __future__ import annotations

import dataclasses
import math
import os
import stat

import numpy as np

from inspect_tool import errors


@dataclasses.dataclass(frozen=True)
class Batch:
  tokens: np.ndarray  # (B, S) int32
  positions: np.ndarray  # (B, S) int32
  segment_ids: np.ndarray  # (B, S) int32
  targets: np.ndarray  # (B, S) int32
  target_mask: np.ndarray  # (B, S) int32


def _npy_header(f, path: str, what: str) -> tuple[tuple[int, ...], np.dtype, int]:
  """(shape, dtype, data offset) from a .npy header, before any array memory is allocated."""
  fmt = np.lib.format
  try:
    if f.read(6) != b"\x93NUMPY":
      raise errors.InputError(f"{what} file {path!r} is not a .npy array (no NumPy header); save it with numpy.save")
    f.seek(0)
    version = fmt.read_magic(f)
    read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
    shape, _, dtype = read(f)
  except (ValueError, OSError, SyntaxError, TypeError) as e:
    raise errors.InputError(f"{what} file {path!r} has a corrupt .npy header: {str(e).splitlines()[0][:120]}") from None
  if dtype.hasobject:
    raise errors.InputError(f"{what} file {path!r} holds Python objects; expected an integer array (int32)")
  return tuple(shape), dtype, f.tell()


def load_array(path: str, what: str) -> np.ndarray:
  """The array of a .npy file, after checking it is a readable regular file whose header fits its size."""
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    raise errors.InputError(f"{what} file {path!r} does not exist") from None
  except OSError as e:
    raise errors.InputError(f"{what} file {path!r} cannot be read: {e.strerror or e}") from None
  if stat.S_ISDIR(mode):
    raise errors.InputError(f"{what} file {path!r} is a directory; expected a .npy file")
  if not stat.S_ISREG(mode):
    raise errors.InputError(f"{what} file {path!r} is not a regular file (FIFO, socket or device)")
  try:
    with open(path, "rb") as f:
      shape, dtype, offset = _npy_header(f, path, what)
      size = os.fstat(f.fileno()).st_size
  except OSError as e:
    raise errors.InputError(f"{what} file {path!r} cannot be read: {e.strerror or e}") from None
  count = math.prod(shape)
  if count * dtype.itemsize > size - offset:
    raise errors.InputError(f"{what} file {path!r}: its header claims shape {shape} ({count} elements of "
                            f"{dtype}), but the file holds only {max(size - offset, 0)} data bytes")
  try:
    return np.load(path, allow_pickle=False)
  except (ValueError, OSError) as e:
    raise errors.InputError(f"{what} file {path!r} is not a .npy array: {str(e).splitlines()[0]}") from None


def check_tokens(tokens: np.ndarray, *, vocab_size: int, max_target_length: int, what: str = "tokens") -> np.ndarray:
  """Returns tokens as int32 (B, S) or raises one line naming what is wrong and what is accepted."""
  if tokens.ndim != 2:
    raise errors.InputError(f"{what} have shape {tokens.shape}; expected rank 2 (batch, seq)")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise errors.InputError(f"{what} have dtype {tokens.dtype}; expected an integer dtype (int32)")
  if tokens.shape[0] < 1 or tokens.shape[1] < 1:
    raise errors.InputError(f"{what} have shape {tokens.shape}; batch and sequence must be non-empty")
  if tokens.shape[1] > max_target_length:
    raise errors.InputError(f"{what} have sequence length {tokens.shape[1]} > max_target_length={max_target_length}; "
                            "pass a shorter batch or max_target_length=<n>")
  low, high = int(tokens.min()), int(tokens.max())
  if low < 0 or high >= vocab_size:
    bad = low if low < 0 else high
    raise errors.InputError(f"{what} hold id {bad}, outside the vocabulary [0, {vocab_size - 1}] "
                            f"(vocab_size={vocab_size})")
  return tokens.astype(np.int32)


def make_batch(tokens: np.ndarray, targets: np.ndarray | None = None) -> Batch:
  batch, seq = tokens.shape
  if targets is None:
    targets = np.roll(tokens, -1, axis=1)
  elif targets.shape != tokens.shape:
    raise errors.InputError(f"targets have shape {targets.shape}; expected the tokens' shape {tokens.shape}")
  positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
  ones = np.ones((batch, seq), np.int32)
  return Batch(tokens, positions, ones, targets.astype(np.int32), ones.copy())


def fixed_tokens(batch: int, seq: int, vocab_size: int) -> np.ndarray:
  """The deterministic batch of the reference golden data: ((arange(B*S) * 37 + 11) % V)."""
  return ((np.arange(batch * seq).reshape(batch, seq) * 37 + 11) % vocab_size).astype(np.int32)


def load_batch(tokens_path: str | None, targets_path: str | None, *, vocab_size: int, max_target_length: int,
               default_shape: tuple[int, int] = (2, 16)) -> Batch:
  """Loads and checks token (and target) files; without a token file, uses the fixed reference batch."""
  if tokens_path is None:
    tokens = fixed_tokens(*default_shape, vocab_size)
  else:
    tokens = check_tokens(load_array(tokens_path, "tokens"), vocab_size=vocab_size, max_target_length=max_target_length)
  targets = None
  if targets_path is not None:
    targets = check_tokens(load_array(targets_path, "targets"), vocab_size=vocab_size,
                           max_target_length=max_target_length, what="targets")
  return make_batch(tokens, targets)
