"""A step whose ``manifest.ocdbt`` is lost: restoring it raises one error, with or without a
target: ``ArrayNotFoundError`` (a ``ValueError`` and ``FileNotFoundError``, as stock Orbax's
types) naming the array and where it was looked for."""

import re

import numpy as np
import orbax.checkpoint as ocp
import pytest

from orbax_pathways import errors

from support import ckpt
from support.arrays import abstract, mesh, put


def _lost_manifest(tmp_path):
  m = mesh((4, 2))
  state = {'kernel': put(np.arange(64, dtype=np.float32).reshape(8, 8), m, 'data', 'model')}
  ckpt.save(tmp_path, state)
  item = tmp_path / '0' / 'default'
  (item / 'manifest.ocdbt').unlink()
  return state, item


def _restore_error(tmp_path, args=None) -> errors.ArrayNotFoundError:
  with ocp.CheckpointManager(tmp_path) as mngr:
    with pytest.raises(errors.ArrayNotFoundError) as caught:
      mngr.restore(0, args=args)
  return caught.value


def test_lost_manifest_same_error_with_and_without_target(tmp_path):
  state, item = _lost_manifest(tmp_path)
  without = _restore_error(tmp_path)
  with_target = _restore_error(tmp_path, ocp.args.StandardRestore(abstract(state)))
  for e in (without, with_target):
    assert isinstance(e, ValueError) and isinstance(e, FileNotFoundError)
    assert str(e).startswith(f"Array 'kernel' not found at {item}/kernel: "), str(e)[:300]
    assert 'orbax-pathways show' in str(e)
  # The same message both ways, up to tensorstore's own text.
  head = lambda e: re.sub(r': NOT_FOUND.*?\. The step', ': NOT_FOUND ... The step', str(e), flags=re.S)
  assert head(without) == head(with_target)
