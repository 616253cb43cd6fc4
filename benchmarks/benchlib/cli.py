"""Command-line flags of ``bench.py`` and the process environment they imply.

Called first by ``bench.py`` (in the main process and in every RSS subprocess), before jax is
imported: ``set_platform_env`` forces the CPU platform with 8 host devices in cpu and gcs modes,
which jax reads only at import.
"""

from __future__ import annotations

import argparse
import os

from benchlib import IMPLS

PROFILE_METRICS = ('save', 'commit', 'restore', 'restore_fewer', 'tiny_save', 'tiny_restore')


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
  """The flags, with --quick and per-mode defaults resolved (size 2 GiB, 8 in gpu; 3 reps)."""
  p = argparse.ArgumentParser(description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument('--mode', choices=('cpu', 'gcs', 'gpu'), default='cpu')
  p.add_argument('--size-gb', type=float, default=None,
                 help='logical (unique) bytes of the state in GiB; default 2 (cpu, gcs), 8 (gpu)')
  p.add_argument('--reps', type=int, default=None, help='repetitions per handler (default 3)')
  p.add_argument('--quick', action='store_true', help='smoke run: 0.25 GiB, 2 reps')
  p.add_argument('--dir', default=None, help='checkpoint root (default: a fresh dir under /tmp)')
  p.add_argument('--json-out', default=None, help='also write the JSON result to this file')
  p.add_argument('--warmup', type=int, default=1,
                 help='untimed rounds of both handlers before the timed reps (default 1)')
  p.add_argument('--tiny-iters', type=int, default=5,
                 help='tiny-checkpoint samples per rep (after one untimed round)')
  p.add_argument('--no-rss', action='store_true', help='skip the peak-RSS subprocesses')
  p.add_argument('--d2h-ref', action='store_true',
                 help='also time a pinned_host device-to-host copy of the state (on in gpu mode)')
  p.add_argument('--profile', default=None, choices=PROFILE_METRICS,
                 help='after the benchmark, run one more iteration of this metric with py-spy '
                 'attached and print the top-15 frames (--profile-impl picks the handler)')
  p.add_argument('--profile-impl', choices=IMPLS, default='ours')
  p.add_argument('--profile-native', action='store_true', help='py-spy --native (C++ frames)')
  p.add_argument('--seed', type=int, default=0)
  # private: one peak-RSS measurement in a fresh interpreter (benchlib.rss)
  p.add_argument('--_rss-worker', dest='rss_worker', choices=IMPLS, default=None,
                 help=argparse.SUPPRESS)
  p.add_argument('--_restore-worker', dest='restore_worker', choices=IMPLS, default=None,
                 help=argparse.SUPPRESS)
  p.add_argument('--_ckpt', dest='worker_ckpt', default=None, help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.quick:
    a.size_gb = 0.25 if a.size_gb is None else a.size_gb
    a.reps = 2 if a.reps is None else a.reps
  if a.size_gb is None:
    a.size_gb = 8.0 if a.mode == 'gpu' else 2.0
  if a.reps is None:
    a.reps = 3
  if a.mode == 'gpu':
    a.d2h_ref = True
  return a


def set_platform_env(mode: str) -> None:
  """cpu / gcs: JAX_PLATFORMS=cpu and 8 forced host devices (unless XLA_FLAGS sets a count)."""
  if mode in ('cpu', 'gcs'):
    os.environ['JAX_PLATFORMS'] = 'cpu'
    flags = os.environ.get('XLA_FLAGS', '')
    if 'xla_force_host_platform_device_count' not in flags:
      os.environ['XLA_FLAGS'] = (flags + ' --xla_force_host_platform_device_count=8').strip()
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def quiet_logs() -> None:
  """absl and orbax_pathways logs down to errors / warnings, so the output is the report."""
  import logging
  logging.getLogger('absl').setLevel(logging.ERROR)
  logging.getLogger('orbax_pathways').setLevel(logging.WARNING)
  try:
    from absl import logging as absl_logging
    absl_logging.set_verbosity(absl_logging.ERROR)
  except ImportError:
    pass
  import warnings
  warnings.filterwarnings('ignore', message='.*overriding.*')
