"""Where restore time goes on this machine: save, restore (same mesh), restore (half the devices),
each with wall time, user and system CPU time, minor page faults and transparent-huge-page faults.

Stock and ours alternate in one process on the state of ``bench.py`` (``benchlib.workloads``).
Written to show that the variance of the "restore, same mesh" row of ``bench.py`` on the 2-core
KVM machine is system time spent zeroing freshly faulted memory (``clear_page_erms`` under
``do_huge_pmd_anonymous_page`` when tensorstore first writes into the restore buffers; numpy
advises huge pages for arrays of 4 MiB or more), which both handlers pay per byte they allocate.
Profile it with ``perf record -g -- .venv/bin/python benchmarks/restore_rusage.py --impls ours``.

    .venv/bin/python benchmarks/restore_rusage.py --reps 3
    PYTHONPATH=/path/to/older/export .venv/bin/python benchmarks/restore_rusage.py  # older code
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import sys
import tempfile
import time

os.environ.setdefault('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _thp_faults() -> int:
  """The kernel's count of transparent-huge-page faults (0 where /proc/vmstat lacks it)."""
  try:
    with open('/proc/vmstat') as f:
      for line in f:
        if line.startswith('thp_fault_alloc '):
          return int(line.split()[1])
  except OSError:
    pass
  return 0


def _phase(label: str, fn) -> None:
  gc.collect()
  h0, ru0, t0 = _thp_faults(), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
  out = fn()
  wall, ru1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
  del out
  print(f'  {label:8s} wall {wall:6.2f} s  user {ru1.ru_utime - ru0.ru_utime:6.2f} s  '
        f'sys {ru1.ru_stime - ru0.ru_stime:6.2f} s  minflt {ru1.ru_minflt - ru0.ru_minflt:8d}  '
        f'thp {_thp_faults() - h0:5d}', flush=True)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  p.add_argument('--impls', default='stock,ours', help='comma-separated: stock, ours')
  p.add_argument('--reps', type=int, default=3)
  p.add_argument('--size-gb', type=float, default=2.0)
  args = p.parse_args()

  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from benchlib import workloads  # pylint: disable=g-import-not-at-top
  from benchlib.handlers import use_handler  # pylint: disable=g-import-not-at-top

  mesh, half = workloads.meshes('cpu')
  state = workloads.build_state(mesh, args.size_gb)
  root = tempfile.mkdtemp(prefix='orbax-restore-rusage-')
  try:
    for rep in range(args.reps):
      for impl in args.impls.split(','):
        use_handler(impl)
        print(f'{impl} rep {rep}', flush=True)
        path = os.path.join(root, f'{impl}{rep}')
        with ocp.CheckpointManager(path) as mngr:
          def save():
            mngr.save(1, args=ocp.args.StandardSave(state))
            mngr.wait_until_finished()

          def restore(m):
            target = workloads.abstract(state, m)
            return jax.block_until_ready(mngr.restore(1, args=ocp.args.StandardRestore(target)))

          _phase('save', save)
          _phase('restore', lambda: restore(None))
          _phase('half', lambda: restore(half))
        shutil.rmtree(path)
  finally:
    shutil.rmtree(root, ignore_errors=True)


if __name__ == '__main__':
  main()
