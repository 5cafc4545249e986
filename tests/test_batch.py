"""Token batches: checks with one-line messages, MaxText's positions/segments/targets."""

import numpy as np
import pytest

from inspect_tool import errors
from inspect_tool.run import batch


def test_fixed_tokens_match_reference_inputs():
  tokens = batch.fixed_tokens(2, 16, 1024)
  assert tokens[0, :3].tolist() == [11, 48, 85] and tokens.dtype == np.int32
  b = batch.make_batch(tokens)
  assert (b.targets == np.roll(tokens, -1, axis=1)).all() and b.positions[1].tolist() == list(range(16))
  assert b.segment_ids.sum() == 32 and b.target_mask.sum() == 32


@pytest.mark.parametrize("tokens,message", [
    (np.zeros((4,), np.int32), "expected rank 2"),
    (np.zeros((2, 4), np.float32), "expected an integer dtype"),
    (np.full((2, 4), 1024, np.int32), "hold id 1024, outside the vocabulary [0, 1023]"),
    (np.full((2, 4), -1, np.int64), "hold id -1"),
    (np.zeros((2, 40), np.int32), "sequence length 40 > max_target_length=32"),
])
def test_bad_tokens(tokens, message):
  with pytest.raises(errors.InputError) as info:
    batch.check_tokens(tokens, vocab_size=1024, max_target_length=32)
  assert message in str(info.value)


def test_load_batch_files(tmp_path):
  tokens = np.arange(8, dtype=np.int64).reshape(2, 4)
  np.save(tmp_path / "t.npy", tokens)
  np.save(tmp_path / "y.npy", tokens[:, ::-1].copy())
  b = batch.load_batch(str(tmp_path / "t.npy"), str(tmp_path / "y.npy"), vocab_size=10, max_target_length=8)
  assert b.tokens.dtype == np.int32 and b.targets[0].tolist() == [3, 2, 1, 0]
  (tmp_path / "bad.npy").write_text("not numpy")
  with pytest.raises(errors.InputError, match="not a .npy array"):
    batch.load_batch(str(tmp_path / "bad.npy"), None, vocab_size=10, max_target_length=8)
  with pytest.raises(errors.InputError, match="does not exist"):
    batch.load_batch(str(tmp_path / "missing.npy"), None, vocab_size=10, max_target_length=8)
  np.save(tmp_path / "short.npy", tokens[:, :2].copy())
  with pytest.raises(errors.InputError, match="expected the tokens' shape"):
    batch.load_batch(str(tmp_path / "t.npy"), str(tmp_path / "short.npy"), vocab_size=10, max_target_length=8)
