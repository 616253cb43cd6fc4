"""Worker-side half of the multi-process JAX test harness (see ``mp_harness.py``): runs in each
``jax.distributed`` worker process that ``mp_harness.run_processes`` starts.

A worker script does::

    from support import mp_worker as w
    w.init()                      # jax.distributed.initialize from the harness's env vars
    ...                           # jax / orbax work; w.shared_dir() is common to all workers
    w.emit({'checksum': ...})     # JSON result handed back to the parent

The harness puts ``tests/`` on ``PYTHONPATH``, so ``from support import mp_worker`` works
from a script anywhere. Everything is read from environment variables that the harness sets;
``XLA_FLAGS`` / ``JAX_PLATFORMS`` are set before the interpreter starts, so they are in force
when jax is first imported.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

# Environment contract between mp_harness (parent) and this module (child).
ENV_COORDINATOR = 'MP_COORDINATOR_ADDRESS'  # '127.0.0.1:<port>'
ENV_NUM_PROCESSES = 'MP_NUM_PROCESSES'
ENV_PROCESS_ID = 'MP_PROCESS_ID'
ENV_RESULTS_DIR = 'MP_RESULTS_DIR'  # the parent reads <dir>/process_<id>.jsonl
ENV_SHARED_DIR = 'MP_SHARED_DIR'  # one directory shared by every worker of a run
ENV_DEVICES_PER_PROCESS = 'MP_DEVICES_PER_PROCESS'
ENV_INIT_TIMEOUT = 'MP_INIT_TIMEOUT'  # seconds, jax.distributed initialization_timeout
ENV_PARENT_PID = 'MP_PARENT_PID'  # the harness process; workers die with it

_initialized = False


def _die_with_parent() -> None:
  """PR_SET_PDEATHSIG=SIGKILL: the kernel kills this worker when the harness process dies
  (even by SIGKILL, when its own cleanup cannot run). Linux only; a no-op elsewhere."""
  # Popped so that a Python grandchild importing this module does not mistake the worker
  # for a dead harness.
  parent = os.environ.pop(ENV_PARENT_PID, None)
  if not parent or not sys.platform.startswith('linux'):
    return
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    import signal  # pylint: disable=g-import-not-at-top

    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
  except Exception:  # pylint: disable=broad-except
    return
  if os.getppid() != int(parent):  # the parent died before prctl took effect
    os._exit(1)  # pylint: disable=protected-access


_die_with_parent()


def _env(name: str) -> str:
  try:
    return os.environ[name]
  except KeyError:
    raise RuntimeError(
        f'{name} is not set: this script must be started by support.mp_harness.run_processes'
    ) from None


def process_id() -> int:
  return int(_env(ENV_PROCESS_ID))


def num_processes() -> int:
  return int(_env(ENV_NUM_PROCESSES))


def devices_per_process() -> int:
  return int(_env(ENV_DEVICES_PER_PROCESS))


def shared_dir() -> str:
  """A directory common to all processes of one ``run_processes`` call."""
  return _env(ENV_SHARED_DIR)


def results_path(pid: int | None = None) -> str:
  pid = process_id() if pid is None else pid
  return os.path.join(_env(ENV_RESULTS_DIR), f'process_{pid}.jsonl')


def init(*, check_devices: bool = True) -> None:
  """Configures the CPU backend (gloo collectives) and calls ``jax.distributed.initialize``.

  Must run before anything touches a jax backend (``jax.devices()``, creating arrays, ...).
  Idempotent within a process.
  """
  global _initialized
  if _initialized:
    return
  import jax  # pylint: disable=g-import-not-at-top

  # Cross-process collectives on the CPU backend. In jax 0.10.2 this option
  # (env JAX_CPU_COLLECTIVES_IMPLEMENTATION) already defaults to 'gloo', and
  # xla_bridge.make_cpu_client then builds make_gloo_tcp_collectives(distributed_client=...).
  # Set it explicitly so an older jax (default None) or a stray env var cannot turn it off:
  # without it, computations spanning processes fail. Must happen before backend init.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.config.update('jax_platforms', 'cpu')
  kwargs: dict[str, Any] = dict(
      coordinator_address=_env(ENV_COORDINATOR),
      num_processes=num_processes(),
      process_id=process_id(),
  )
  init_timeout = os.environ.get(ENV_INIT_TIMEOUT)
  if init_timeout:
    kwargs['initialization_timeout'] = int(float(init_timeout))
  jax.distributed.initialize(**kwargs)
  _initialized = True
  _install_fail_fast_excepthook()
  if check_devices:
    n, d = num_processes(), devices_per_process()
    if jax.process_count() != n or jax.process_index() != process_id():
      raise RuntimeError(
          f'jax sees process {jax.process_index()}/{jax.process_count()}, '
          f'harness said {process_id()}/{n}'
      )
    if jax.local_device_count() != d or jax.device_count() != n * d:
      raise RuntimeError(
          f'jax sees {jax.local_device_count()} local / {jax.device_count()} global devices, '
          f'expected {d} / {n * d} (XLA_FLAGS={os.environ.get("XLA_FLAGS")!r})'
      )


def _install_fail_fast_excepthook() -> None:
  """An uncaught exception ends the worker at once, with status 1.

  Without this, a worker whose script raised does not exit: jax.distributed registers an
  atexit ``shutdown()`` that waits in a barrier for all peers, and the peers are themselves
  blocked in a collective with the dead worker (gloo gives up after ~30 s, the coordination
  service heartbeat after 100 s). Measured: a raising worker's exit was delayed by ~31 s.
  ``os._exit`` skips atexit, the parent sees the failure immediately and kills the rest.
  ``SystemExit`` (sys.exit) does not pass through excepthook and still runs atexit.
  """
  import traceback  # pylint: disable=g-import-not-at-top

  def hook(exc_type, exc, tb):
    try:
      sys.stderr.write(''.join(traceback.format_exception(exc_type, exc, tb)))
      sys.stderr.flush()
      sys.stdout.flush()
    finally:
      os._exit(1)  # pylint: disable=protected-access

  sys.excepthook = hook


def _json_default(o: Any) -> Any:
  # numpy scalars/arrays, jax arrays (fully addressable ones), sets, paths.
  if hasattr(o, 'tolist'):
    return o.tolist()
  if isinstance(o, (set, frozenset, tuple)):
    return list(o)
  if isinstance(o, os.PathLike):
    return os.fspath(o)
  if isinstance(o, bytes):
    return o.decode('latin-1')
  raise TypeError(f'emit(): cannot JSON-encode {type(o).__name__}')


def emit(obj: Any) -> None:
  """Hands a JSON-serialisable result to the parent.

  May be called more than once; the parent's ``ProcessResult.result`` is the last object
  emitted and ``ProcessResult.results`` all of them, in order. Each call appends one line and
  fsyncs, so results emitted before a later crash still reach the parent.
  """
  line = json.dumps(obj, default=_json_default, sort_keys=True)
  with open(results_path(), 'a', encoding='utf-8') as f:
    f.write(line + '\n')
    f.flush()
    os.fsync(f.fileno())


def shard_digests(arr: Any) -> list[dict[str, Any]]:
  """This process's shards of ``arr``: device, process, index box ([start, stop] per dim), dtype
  and sha256 of the bytes, sorted by device id. The parent compares them with its own values."""
  import hashlib  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  out = []
  for sh in arr.addressable_shards:
    data = np.ascontiguousarray(np.asarray(sh.data))
    idx = [list(s.indices(dim)[:2]) for s, dim in zip(sh.index, arr.shape)]
    out.append({'device': sh.device.id, 'process': sh.device.process_index, 'index': idx,
                'dtype': str(data.dtype), 'sha': hashlib.sha256(data.tobytes()).hexdigest()})
  return sorted(out, key=lambda d: d['device'])


def log(*args: Any) -> None:
  """print() to stderr with a process prefix (stderr tails are shown on failure)."""
  print(f'[p{os.environ.get(ENV_PROCESS_ID, "?")}]', *args, file=sys.stderr, flush=True)


def stop_all_now(timeout_s: float = 60.0, *, kill: bool = False) -> None:
  """Every process of the job stops at once without closing anything (a preempted job; with
  ``kill``, SIGKILLed), and the coordination service's host (process 0) last, so that no peer
  sees the service vanish first and is aborted by jax instead.

  Call it on every process at the point where it is to stop. Process i > 0 writes
  ``stopped.<i>`` into its results directory and ends at once; process 0 waits for every marker
  (at most ``timeout_s``), gives the others a moment to be gone, and ends too. Measured without
  the order: process 0's exit right after ``sync_global_devices`` aborted a peer in 1 of 7 runs
  here; with it, 0 of 25 ("Terminating process because the JAX distributed service detected
  fatal errors").
  """
  import signal  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top

  def end():
    if kill:
      os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # pylint: disable=protected-access

  sys.stdout.flush()
  sys.stderr.flush()
  folder = os.path.dirname(results_path())
  me, n = process_id(), num_processes()
  if me:
    open(os.path.join(folder, f'stopped.{me}'), 'w').close()
    end()
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline and not all(
      os.path.exists(os.path.join(folder, f'stopped.{p}')) for p in range(1, n)):
    time.sleep(0.02)
  time.sleep(0.5)
  end()
