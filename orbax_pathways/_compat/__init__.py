"""Compatibility layer: the only modules that import ``orbax.checkpoint._src``.

``orbax.py`` covers serialization (specs, sharding files, array-metadata store, registry);
``orbax_manager.py`` covers the CheckpointManager side (deletion, step listing, preemption).
"""
