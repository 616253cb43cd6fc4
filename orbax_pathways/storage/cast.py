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
converter the ``cast`` driver uses: ``tests/test_casts.py`` compares it with what the driver
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
  try:
    out = ts.cast(ts.array(data, copy=False), ts.dtype(target.name)).read().result()
  except Exception as e:  # tensorstore's ValueError: no such dtype or conversion
    raise ValueError(
        f'Cannot cast {what} from {data.dtype.name} to {target.name}: tensorstore, which '
        f'converts the stored values, has no such conversion ({type(e).__name__}: {e}). '
        f'{fix}.') from e
  return np.asarray(out)


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
