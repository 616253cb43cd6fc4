"""Child interpreters forked from one that has already imported jax, Orbax and tensorstore.

The suite starts hundreds of Python children (``jax.distributed`` processes, workers, the CLI),
and each fresh interpreter spends about 2.3 CPU-s importing jax, Orbax and tensorstore before it
does anything: on the 2 cores of CI that was most of the suite's time. ``Popen`` here is
``subprocess.Popen`` with one difference: a child that runs this same interpreter (``python
-m module``, ``python script.py``, ``python -c code``) is forked from a *zygote*, a server
process of this module that imported those libraries once (and nothing of ``orbax_pathways``
or of the tests), instead of being exec'd. What the child then runs is exactly what it would
run in a fresh interpreter: its ``argv``, environment, working directory, standard streams,
session, and its own import of the package under test.

How the child still behaves as the caller's own child: the caller (each pytest worker, the
chaos harness) makes itself a *child subreaper* (Linux ``PR_SET_CHILD_SUBREAPER``); the zygote
forks an intermediate that forks the child and exits at once, so the child is re-parented to
the caller before its pid is returned, and ``Popen.wait``, ``poll``, ``kill``, pipes and
``communicate`` work unchanged.

Falls back to an ordinary exec (``subprocess.Popen``'s own) for anything else: another program
or interpreter, ``shell``, ``preexec_fn``, ``pass_fds``, user or group changes, interpreter
flags other than ``-u`` and ``-B``; off where ``PATHWAYS_TEST_ZYGOTE=0``, off the Linux
kernel, and whenever a zygote cannot be reached. jax reads some ``JAX_*`` variables at import,
so there is one zygote per distinct set of them.
"""

from __future__ import annotations

import ctypes
import io
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

PRELOAD = ('numpy', 'jax', 'tensorstore', 'orbax.checkpoint')
# jax reads these when a job calls jax.distributed.initialize, not at import.
_READ_AT_CALL = frozenset({'JAX_COORDINATOR_ADDRESS', 'JAX_NUM_PROCESSES', 'JAX_PROCESS_ID'})
_ENV_SWITCH = 'PATHWAYS_TEST_ZYGOTE'
_PR_SET_CHILD_SUBREAPER = 36

_lock = threading.Lock()
_zygotes: dict[tuple, '_Zygote | None'] = {}
_subreaper: bool | None = None


def _import_key(env: dict[str, str]) -> tuple:
  """What the zygote's imports read from the environment: children differing in it get
  different zygotes."""
  return tuple(sorted((k, v) for k, v in env.items()
                      if (k.startswith('JAX_') and k not in _READ_AT_CALL)
                      or k in ('PYTHONPATH', 'PYTHONHASHSEED', 'TF_CPP_MIN_LOG_LEVEL')))


def _make_subreaper() -> bool:
  global _subreaper
  if _subreaper is None:
    try:
      libc = ctypes.CDLL(None, use_errno=True)
      _subreaper = sys.platform.startswith('linux') and libc.prctl(
          _PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
      _subreaper = False
  return _subreaper


def _parse(args: list[str]) -> dict[str, Any] | None:
  """``python [-u] [-B] (-m module | -c code | script) args...`` of this interpreter."""
  if not args or args[0] != sys.executable:
    return None
  rest, unbuffered = args[1:], False
  while rest and rest[0] in ('-u', '-B'):
    unbuffered |= rest[0] == '-u'
    rest = rest[1:]
  if len(rest) >= 2 and rest[0] in ('-m', '-c'):
    kind = 'module' if rest[0] == '-m' else 'code'
    return dict(kind=kind, target=rest[1], args=rest[2:], unbuffered=unbuffered)
  if rest and not rest[0].startswith('-'):
    return dict(kind='path', target=rest[0], args=rest[1:], unbuffered=unbuffered)
  return None


class _Zygote:
  """The caller's end of one zygote server."""

  def __init__(self, env: dict[str, str]):
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    zenv = dict(env)
    zenv['OPENBLAS_NUM_THREADS'] = '1'  # no thread in the zygote: forking it stays clean
    self.proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
        env=zenv, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    theirs.close()
    self.sock = ours
    self.file = ours.makefile('rb')

  def spawn(self, request: dict[str, Any], fds: list[int]) -> int:
    data = json.dumps(request).encode()
    socket.send_fds(self.sock, [struct.pack('!I', len(data)) + data], fds)
    line = self.file.readline()
    if not line:
      raise OSError('the zygote closed its socket')
    return int(line)

  def close(self) -> None:
    self.sock.close()
    self.proc.wait()


def _spawn(request: dict[str, Any], env: dict[str, str], fds: list[int]) -> int | None:
  """The pid of the forked child, or None (no zygote: the caller execs)."""
  key = _import_key(env)
  with _lock:
    zygote = _zygotes.get(key, ...)
    if zygote is ...:
      try:
        zygote = _Zygote(env)
      except OSError:
        zygote = None
      _zygotes[key] = zygote
    if zygote is None:
      return None
    try:
      return zygote.spawn(request, fds)
    except (OSError, ValueError):
      _zygotes[key] = None  # gone: exec from now on
      return None


class Popen(subprocess.Popen):
  """``subprocess.Popen``; a child of this interpreter is forked from a zygote (module
  docstring)."""

  def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                     startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                     errread, errwrite, restore_signals, gid, gids, uid, umask,
                     start_new_session, process_group):
    parsed = None
    if (os.environ.get(_ENV_SWITCH, '1') != '0' and not shell and preexec_fn is None
        and not pass_fds and executable is None and gid is None and gids is None
        and uid is None and isinstance(args, (list, tuple)) and _make_subreaper()):
      parsed = _parse([os.fspath(a) for a in args])
    pid = None
    if parsed is not None:
      child_env = {os.fsdecode(k): os.fsdecode(v)
                   for k, v in (os.environ if env is None else env).items()}
      parsed.update(env=child_env, cwd=os.path.abspath(os.fspath(cwd or os.getcwd())),
                    umask=umask, new_session=bool(start_new_session),
                    process_group=process_group)
      fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1,
             errwrite if errwrite != -1 else 2]
      pid = _spawn(parsed, child_env, fds)
    if pid is None:
      return super()._execute_child(
          args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
          restore_signals, gid, gids, uid, umask, start_new_session, process_group)
    self.pid = pid
    self._child_created = True
    self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)


def run(args, *, input=None, timeout=None, check=False, capture_output=False,
        **kwargs) -> subprocess.CompletedProcess:
  """``subprocess.run`` over this module's ``Popen`` (the same arguments and behaviour)."""
  if capture_output:
    kwargs['stdout'] = kwargs['stderr'] = subprocess.PIPE
  if input is not None:
    kwargs['stdin'] = subprocess.PIPE
  with Popen(args, **kwargs) as process:
    try:
      stdout, stderr = process.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired as e:
      process.kill()
      e.stdout, e.stderr = process.communicate()
      raise
    except BaseException:
      process.kill()
      raise
  code = process.poll()
  if check and code:
    raise subprocess.CalledProcessError(code, process.args, output=stdout, stderr=stderr)
  return subprocess.CompletedProcess(process.args, code, stdout, stderr)


# ---- the zygote server (this file run as a script) -------------------------------------------


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
  head, fds, _, _ = socket.recv_fds(sock, 4, 8)
  if not head:
    return None
  while len(head) < 4:
    head += sock.recv(4 - len(head))
  (size,) = struct.unpack('!I', head[:4])
  data = b''
  while len(data) < size:
    chunk = sock.recv(size - len(data))
    if not chunk:
      return None
    data += chunk
  return json.loads(data), list(fds)


def _serve(fd: int) -> dict[str, Any] | None:
  """The zygote's loop: per request, a child forked through an intermediate (so that it is
  re-parented to the caller, a subreaper) whose pid is answered once the intermediate exited.
  Returns the request in the child; None in the zygote once its caller is gone."""
  sock = socket.socket(fileno=fd)
  while True:
    got = _recv(sock)
    if got is None:
      return None
    request, fds = got
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
      middle_self = os.getpid()
      os.close(r)
      child = os.fork()
      if child == 0:
        os.close(w)
        sock.close()
        # Runs once re-parented to the caller, as an exec'd child would be from the start (a
        # worker that checks its parent's pid, or asks to die with it, sees the caller).
        while os.getppid() == middle_self:
          time.sleep(0.001)
        try:
          _enter(request, fds)
        except BaseException:  # pylint: disable=broad-except  (the child's own stderr says why)
          import traceback  # pylint: disable=import-outside-toplevel
          os.write(2, traceback.format_exc().encode())
          os._exit(1)  # pylint: disable=protected-access
        return request
      os.write(w, b'%d\n' % child)
      os._exit(0)  # pylint: disable=protected-access
    os.close(w)
    for f in fds:
      os.close(f)
    with os.fdopen(r, 'rb') as pipe:
      pid = pipe.readline()
    os.waitpid(middle, 0)
    sock.sendall(pid if pid else b'-1\n')


def _stream(fd: int, mode: str, unbuffered: bool) -> io.TextIOWrapper:
  raw = io.FileIO(fd, mode, closefd=False)
  if mode == 'r':
    return io.TextIOWrapper(io.BufferedReader(raw), encoding='utf-8', errors='strict')
  buffered = raw if unbuffered else io.BufferedWriter(raw)
  return io.TextIOWrapper(buffered, encoding='utf-8',
                          errors='backslashreplace' if fd == 2 else 'strict',
                          line_buffering=fd == 2 or raw.isatty(), write_through=unbuffered)


def _enter(request: dict[str, Any], fds: list[int]) -> None:
  """In the child: the session, standard streams, directory, environment and ``sys`` state a
  fresh interpreter started as requested would have."""
  for target, fd in enumerate(fds):
    if fd != target:
      os.dup2(fd, target)
  os.closerange(3, 65536)
  if request['new_session']:
    os.setsid()
  elif (request.get('process_group') or -1) >= 0:
    os.setpgid(0, request['process_group'])
  if request.get('umask', -1) >= 0:
    os.umask(request['umask'])
  os.chdir(request['cwd'])
  env = request['env']
  unbuffered = request['unbuffered'] or bool(env.get('PYTHONUNBUFFERED'))
  os.environ.clear()
  os.environ.update(env)
  sys.stdin = _stream(0, 'r', False)
  sys.stdout = _stream(1, 'w', unbuffered)
  sys.stderr = _stream(2, 'w', True)
  sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
  base = [p for p in sys.path[1:] if p not in _zygote_pythonpath]
  extra = [p for p in env.get('PYTHONPATH', '').split(os.pathsep) if p]
  first = {'module': os.getcwd(), 'code': '',
           'path': os.path.dirname(os.path.abspath(request['target']))}[request['kind']]
  sys.path[:] = [first] + extra + base


def _run(request: dict[str, Any]) -> None:
  import runpy  # pylint: disable=import-outside-toplevel
  if request['kind'] == 'module':
    sys.argv = [request['target'], *request['args']]
    runpy.run_module(request['target'], run_name='__main__', alter_sys=True)
  elif request['kind'] == 'path':
    sys.argv = [request['target'], *request['args']]
    runpy.run_path(request['target'], run_name='__main__')
  else:
    sys.argv = ['-c', *request['args']]
    main = sys.modules['__main__']
    for name in [n for n in vars(main) if not n.startswith('__')]:
      delattr(main, name)
    exec(compile(request['target'], '<string>', 'exec'), vars(main))  # pylint: disable=exec-used


_zygote_pythonpath: list[str] = []

if __name__ == '__main__':
  _zygote_pythonpath = [p for p in os.environ.get('PYTHONPATH', '').split(os.pathsep) if p]
  for _name in PRELOAD:
    __import__(_name)
  _request = _serve(int(sys.argv[1]))
  if _request is None:
    sys.exit(0)
  del _name
  _run(_request)
