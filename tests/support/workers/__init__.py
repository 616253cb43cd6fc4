"""Worker scripts started by ``support.mp_harness.run_processes`` (one ``jax.distributed``
process each). Their top halves are numpy-only, so a parent test imports them as modules to
compute what the workers must report."""
