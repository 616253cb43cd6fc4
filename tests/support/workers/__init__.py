"""Every Python program a test runs in a child process, one module each: a ``main()`` and a
docstring saying what it does and which test runs it.

Started through ``support.procs`` (one interpreter: ``procs.run_worker(module, *args)``, which
runs ``python -m support.workers.<name>``) or ``support.mp_harness.run_processes(module.__file__,
...)`` (N ``jax.distributed`` processes; those call ``support.mp_worker.init()`` first). Both
give the child the suite's environment (``procs.child_env``). Imports at the top of a worker are
light (numpy at most; jax, Orbax and orbax_pathways inside ``main()``), so a parent test imports
a worker as a module to reach its constants and compute what it must report.
(``emergency_worker``, the manager side's, predates this and runs at import;
``mp_sigterm_worker`` imports orbax_pathways at its top, which its ``spawn`` children re-import;
they are only started, never imported.)
"""
