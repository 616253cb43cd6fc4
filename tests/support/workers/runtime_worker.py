"""One ``jax.distributed`` process reporting the runtime and transport it detects, for
``tests/transports/test_transports.py``
(``test_multi_controller_runtime_is_detected_in_a_distributed_process``, ``mp_harness``).

    runtime_worker.py

Emits ``runtime.detect_runtime()`` and ``runtime.choose_transport()`` by value.
"""

from __future__ import annotations


def main() -> None:
  from support import mp_worker  # pylint: disable=g-import-not-at-top

  mp_worker.init()
  from orbax_pathways.engine import runtime  # pylint: disable=g-import-not-at-top

  mp_worker.emit({'runtime': runtime.detect_runtime().value,
                  'transport': runtime.choose_transport().value})


if __name__ == '__main__':
  main()
