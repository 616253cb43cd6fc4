"""The orbax-checkpoint releases every ``_compat`` module is written for (against 0.12.8).

The one place the package writes the range: ``orbax.py``, ``orbax_manager.py``,
``orbax_finalize.py``, ``orbax_liveness.py``, ``orbax_signals.py``, ``orbax_step_metadata.py``,
``orbax_small_writes.py``,
``orbax_loop.py`` and ``orbax_v1_seams.py`` name it from here (the manager's out-of-range
warning, the finalize patch's error). ``pyproject.toml`` declares the same range for pip; ``tests/compat/test_compat.py``
checks that the two agree and that ``.ci/constraints-oldest.txt`` / ``-newest.txt`` pin versions
inside it. Widen it here and in ``pyproject.toml`` together, with a green run on the new pins.
"""

ORBAX = '>=0.12.4,<0.13'
