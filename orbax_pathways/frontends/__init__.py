"""Front doors: adapters from Orbax's APIs to the engine (``orbax_v0``: the TypeHandler registry)."""
