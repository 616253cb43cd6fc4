"""Support code of the test suite: builders, fixtures' machinery and real-process harnesses.

Imported as ``from support import ...``: ``tests/`` is on ``sys.path`` through the ``pythonpath``
option of ``[tool.pytest.ini_options]`` in ``pyproject.toml`` (the only place that sets it for
pytest), and on ``PYTHONPATH`` of every interpreter the tests start (``procs.child_env``, which
``procs.run`` and ``mp_harness.run_processes`` use). Scripts outside ``tests/``
(``integration/``, ``benchmarks/``) put ``TESTS`` on ``sys.path`` themselves before importing.

Modules (each with one job; none imports jax or orbax_pathways at import time unless it says so):

- ``arrays``: meshes, sharded states and tree comparisons on the 8 CPU devices (imports jax).
- ``ckpt``: the library's install state around a block (options, stock Orbax) and saves with it
  (imports orbax_pathways).
- ``procs``: the one helper that starts a child process (a worker, the CLI, a tool) with the
  suite's environment, a time bound and its output on failure; free ports.
- ``gcs_server``, ``fault_proxy``, ``gcs_fixtures``: fake-gcs-server, the fault-injecting proxy
  and the pytest fixtures built on them (``tests/conftest.py`` imports the fixtures).
- ``mp_harness`` (parent) and ``mp_worker`` (child): N real ``jax.distributed`` processes,
  built on ``procs``.
- ``workers/``: every Python program a test runs in a child process, one module each (a
  ``main()``; its docstring says what it does and which test runs it).
- ``conformance``: the test class every ``Transport`` passes (``tests/transports/test_transport_conformance.py``
  subclasses it per transport; imports jax and orbax_pathways).
- ``private_shm``: a worker run as root in a private mount namespace with its own /dev/shm.
- ``golden``: the stock-Orbax golden checkpoints in ``tests/golden`` (never imports
  orbax_pathways).
"""

import os

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
