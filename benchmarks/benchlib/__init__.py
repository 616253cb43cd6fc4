"""The pieces of ``benchmarks/bench.py``, one concern per module.

``bench.py`` (the only entry point; run as ``python benchmarks/bench.py`` from the repository
root, so ``benchmarks/`` is on ``sys.path`` and this package imports as ``benchlib``) parses the
flags, then calls, in order:

  cli         flags, and the process environment that must be set before jax is imported
  storage     where checkpoints go (a local directory or a fake-gcs-server bucket), their removal,
              tensorstore's bytes-read counter
  workloads   the meshes and the states (big, tiny), their byte counts and abstract targets
  handlers    selecting stock or ours through ``orbax_pathways.install()/uninstall()``, and
              checking through ``orbax_pathways.stats`` which one served each call
  measure     the timed save / restore reps in this process
  rss         peak RSS of one save, each in a fresh subprocess (``bench.py --_rss-worker``)
  references  the hardware floors: disk write+fsync, pinned-host device-to-host copy
  profiling   one more iteration of one metric with py-spy attached
  report      medians, mins and ratios; the table, the JSON document

Everything runs on the one host that runs ``bench.py``. No module here imports jax, tensorstore or
Orbax at import time (each function imports them when called), so ``bench.py`` can import them all
before ``cli.set_platform_env`` has set the platform.
"""

import os

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PY = os.path.join(BENCH_DIR, 'bench.py')  # the RSS subprocess runs this same entry point
REPO = os.path.dirname(BENCH_DIR)
TESTS = os.path.join(REPO, 'tests')
MiB = 1 << 20
GiB = 1 << 30
IMPLS = ('stock', 'ours')
