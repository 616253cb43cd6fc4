"""What ``import orbax_pathways`` does in a fresh interpreter, for ``tests/frontends/test_handler.py``
(``procs.run_worker``).

    python -m support.workers.handler_worker registered      (test_opt_out_environment_variable)
    python -m support.workers.handler_worker install_log     (test_install_logs_what_it_installed)
    python -m support.workers.handler_worker x64 CKPT        (test_64_bit_dtypes_round_trip)

``registered``: prints the class name of Orbax's registered ``jax.Array`` handler after the
import (the test sets ``ORBAX_PATHWAYS_DISABLE=1``). ``install_log``: the import under a root
logger at INFO (the install's line goes to stderr). ``x64``: with ``jax_enable_x64``, saves and
restores float64, int64 and uint64 arrays through an unchanged ``CheckpointManager``; exits
non-zero unless dtypes and values come back equal and three arrays were restored by us.
"""

from __future__ import annotations

import logging
import sys


def registered() -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import

  print(type(ocp.type_handlers.get_type_handler(jax.Array)).__name__)


def install_log() -> None:
  logging.basicConfig(level=logging.INFO)
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import


def x64(path: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  jax.config.update('jax_enable_x64', True)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import orbax_pathways  # pylint: disable=g-import-not-at-top

  x = {'f': jnp.arange(16, dtype=jnp.float64) / 3, 'i': jnp.arange(16, dtype=jnp.int64) * 2**40,
       'u': jnp.arange(16, dtype=jnp.uint64) * 2**40}
  with ocp.CheckpointManager(path) as m:
    m.save(0, args=ocp.args.StandardSave(x))
    m.wait_until_finished()
    r = m.restore(0, args=ocp.args.StandardRestore(x))
  assert orbax_pathways.stats.last_restore().arrays == 3
  for k in x:
    assert r[k].dtype == x[k].dtype, (k, r[k].dtype)
    np.testing.assert_array_equal(np.asarray(r[k]), np.asarray(x[k]))


def main() -> None:
  mode, args = sys.argv[1], sys.argv[2:]
  {'registered': registered, 'install_log': install_log, 'x64': x64}[mode](*args)


if __name__ == '__main__':
  main()
