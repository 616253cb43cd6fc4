"""Dtype casts exactly as tensorstore performs them, for checksums of the bytes as stored.

Orbax casts a leaf (v0 ``SaveArgs.dtype``, v1 ``ArrayOptions.Saving.StorageOptions.dtype`` and
its ``scoped_storage_options_creator``) by wrapping the array's spec in tensorstore's ``cast``
driver: the values are converted by tensorstore on their way to storage, and converted back by
a ``cast`` read spec when a restore asks for another dtype (``RestoreArgs.dtype``, a target's
dtype). numpy's ``astype`` is not the same conversion: NaN payloads differ (float32 ->
bfloat16), tensorstore rounds float64 -> bfloat16 through float32 (so ``1 + 2**-8 + 2**-30``
becomes 1.0, not 1.0078125), and bfloat16 -> integer differs for NaN, infinities, negative
values into unsigned types and values out of range. A checksum of numpy's result is then not
the checksum of what storage holds, and the restore of an undamaged checkpoint raises
``ChecksumMismatchError``.

``convert`` converts with tensorstore's own conversion (an in-memory ``ts.cast``, the same
converter the ``cast`` driver uses: ``tests/frontends/test_casts.py`` compares it with what the driver
stores for every dtype pair and the edge values above). No I/O; pure given tensorstore.

Who calls it, on which host: ``storage/writer.chunk_records`` (the checksums of a jax.Array
piece, on the host that writes it), ``engine.write_host_array`` (numpy and scalar leaves, on
process 0: it writes the converted values and checksums those same bytes),
``tier/store._chunks`` (a tier copy holds the stored bytes) and ``storage/reader`` (a restore's
target dtype, after the stored bytes were verified: never before); ``check`` by the front doors
(``frontends/orbax_v0``, every process, inside ``save()``), so that a cast tensorstore cannot do
fails before anything is written.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import tensorstore as ts


SAVE_FIX = ('Save it without this dtype (SaveArgs.dtype / StorageOptions(dtype=...)), or cast '
            'it yourself before saving')
RESTORE_FIX = 'Restore it in its stored dtype (no dtype in the target), then cast it yourself'


def convert(data: Any, dtype: Any, *, what: str = 'array', fix: str = SAVE_FIX) -> np.ndarray:
  """``data`` (numpy, any strides, read-only allowed) as ``dtype``, converted as tensorstore
  converts: the bytes its ``cast`` driver stores. Returns ``data`` itself when it already has
  that dtype. ``what`` names the value and ``fix`` says what to do in the error of a conversion
  tensorstore refuses (the error stock Orbax raises there is tensorstore's own)."""
  data = np.asarray(data)
  target = np.dtype(dtype)
  if data.dtype == target:
    return data
  if numpy_is_exact(data.dtype, target):
    return data.astype(target)
  try:
    out = ts.cast(ts.array(data, copy=False), ts.dtype(target.name)).read().result()
  except Exception as e:  # tensorstore's ValueError: no such dtype or conversion
    raise ValueError(
        f'Cannot cast {what} from {data.dtype.name} to {target.name}: tensorstore, which '
        f'converts the stored values, has no such conversion ({type(e).__name__}: {e}). '
        f'{fix}.') from e
  return np.asarray(out)


# 16-bit float sources: numpy's astype is used where it gives tensorstore's bytes for every one
# of the 65536 inputs (checked once per pair, at first use).
_EXHAUSTIVE_SOURCES = ('bfloat16', 'float16')


@functools.cache
def numpy_is_exact(src: np.dtype, dst: np.dtype) -> bool:
  """Whether numpy's ``astype`` from ``src`` to ``dst`` gives tensorstore's bytes for every
  input, so ``convert`` may take it (tensorstore's in-memory cast is single-threaded and up to
  3x slower for widening casts such as bfloat16 -> float32, a restore's usual one):
  - bool and integer sources into a numpy builtin that holds every value exactly (wider
    integers; floats whose mantissa holds every bit): the exact value either way, no rounding;
  - 16-bit float sources (bfloat16, float16), checked on all 65536 bit patterns against
    tensorstore's conversion.
  Every other pair (narrowing, float -> int, NaN payloads of wider floats) goes to tensorstore."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import  (registers bfloat16 & co.)
  src, dst = np.dtype(src), np.dtype(dst)
  if src.isbuiltin == 1 and dst.isbuiltin == 1 and src.kind in 'biu':  # not ml_dtypes' (2)
    if dst.kind in 'biu':
      return bool(np.can_cast(src, dst, 'safe'))
    if dst.kind in 'fc':  # numpy calls int64 -> float64 safe; it is exact only below 2**53
      bits = 1 if src.kind == 'b' else 8 * src.itemsize - (src.kind == 'i')
      return bits <= np.finfo(dst).nmant + 1
    return False
  if src.name not in _EXHAUSTIVE_SOURCES or dst.itemsize < src.itemsize:
    return False
  every = np.arange(2**16, dtype=np.uint16).view(src)
  try:
    with np.errstate(all='ignore'):
      mine = every.astype(dst)
    theirs = np.asarray(ts.cast(ts.array(every), ts.dtype(dst.name)).read().result())
  except Exception:  # pylint: disable=broad-except  (no such conversion: tensorstore decides)
    return False
  return mine.dtype == theirs.dtype and mine.tobytes() == theirs.tobytes()


def check(src: Any, dtype: Any, *, what: str) -> None:
  """Raises ``convert``'s error now if tensorstore cannot convert ``src`` values to ``dtype``
  (a dtype it does not know, such as ``uint4``): called by the front doors at ``save()``, so
  such a cast writes nothing (stock Orbax fails the same cast in its background commit, with
  tensorstore's own message)."""
  convert(np.zeros((), np.dtype(src)), dtype, what=what)


def cast_spec_dtypes(tspec: dict) -> tuple[np.dtype, np.dtype] | None:
  """(the dtype of the values handed over, the dtype stored) of an Orbax write spec wrapped in
  tensorstore's ``cast`` driver (``{'driver': 'cast', 'dtype': <from>, 'base': {..., 'dtype':
  <stored>}}``, Orbax's ``_maybe_add_cast_to_write_spec``); None for a spec without a cast."""
  if tspec.get('driver') != 'cast':
    return None
  import ml_dtypes  # pylint: disable=g-import-not-at-top,unused-import  (registers bfloat16 & co.)
  return np.dtype(tspec['dtype']), np.dtype(tspec['base']['dtype'])
