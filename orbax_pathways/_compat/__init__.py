"""Compatibility layer: the only modules that reach into Orbax's private ``_src`` package.

``orbax.py`` covers serialization (specs, sharding files, array-metadata store, registry);
``orbax_manager.py`` covers the CheckpointManager side (deletion, step listing, preemption,
listing freshness on gs://).
"""
