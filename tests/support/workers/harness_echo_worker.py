"""A ``jax.distributed`` process of ``tests/multiprocess/test_mp_harness.py``'s
``test_emit_args_env_and_shared_dir`` (``mp_harness``): what the harness handed it.

    harness_echo_worker.py ARGS...

Creates ``hello_<process id>`` in ``shared_dir()``, emits ``{'first': True}``, then its argv
(after the script), the ``EXTRA`` environment variable, jax's process index and count, the
global device count and the CPU collectives implementation.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
  from support import mp_worker as w  # pylint: disable=g-import-not-at-top

  w.init()
  import jax  # pylint: disable=g-import-not-at-top

  open(os.path.join(w.shared_dir(), f'hello_{w.process_id()}'), 'w').close()
  w.emit({'first': True})
  w.emit({'argv': sys.argv[1:], 'extra': os.environ['EXTRA'], 'pid': jax.process_index(),
          'n': jax.process_count(), 'devs': jax.device_count(),
          'coll': jax.config.jax_cpu_collectives_implementation})


if __name__ == '__main__':
  main()
