"""Where the preemption-notice SIGTERM handler gets installed, for ``tests/manager/test_sigterm.py``
(``test_import_and_cli_leave_sigterm_alone_manager_in_main_thread_takes_it``), through
``procs.run``.

    python -m support.workers.sigterm_where_worker DIRECTORY

Imports orbax_pathways and Orbax, constructs (and closes) a CheckpointManager in a thread, then
one in the main thread (in ``DIRECTORY/thread`` and ``DIRECTORY/main``), and prints one JSON
line naming SIGTERM's Python handler after each: ``{"after_import",
"after_manager_off_main_thread", "after_manager"}`` (``default``, ``ignore``, ``native`` or the
handler's qualified name).
"""

from __future__ import annotations

import json
import signal
import sys
import threading


def name(h) -> str:
  return {signal.SIG_DFL: 'default', signal.SIG_IGN: 'ignore', None: 'native'}.get(
      h, getattr(h, '__qualname__', str(h)))


def main() -> None:
  import orbax_pathways  # pylint: disable=g-import-not-at-top,unused-import
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  out = {'after_import': name(signal.getsignal(signal.SIGTERM))}
  t = threading.Thread(target=lambda: ocp.CheckpointManager(sys.argv[1] + '/thread').close())
  t.start()
  t.join()
  out['after_manager_off_main_thread'] = name(signal.getsignal(signal.SIGTERM))
  ocp.CheckpointManager(sys.argv[1] + '/main').close()
  out['after_manager'] = name(signal.getsignal(signal.SIGTERM))
  print(json.dumps(out))


if __name__ == '__main__':
  main()
