"""The package's settings: ``Options`` (``settings.py``), every ``ORBAX_PATHWAYS_*`` variable
(``variables.py``: ``ENV_VARS``, ``parse_env``, ``env_value``) and the names and accepted values
they share (``choices.py``: ``TransportName``, ``Runtime``). ``from orbax_pathways import
options`` reaches all of them here.
"""

from orbax_pathways.options.choices import (COMPRESSIONS, DIVISIBILITIES, FORMER_ENV,
                                            FORMER_FIELDS, FORMER_TRANSPORTS, LOCAL_STEPS_IN,
                                            LOCAL_WHEN_BUSY, MiB, RUNTIMES, Runtime, SNAPSHOTS,
                                            TIER_MAX_AGE_S, TIER_SCOPES, TRANSPORTS,
                                            TransportName)
from orbax_pathways.options.settings import Options
from orbax_pathways.options.variables import (ENV_VARS, EnvVar, FIELD_ENV, env_raw, env_value,
                                              field_default, former_transport,
                                              num_slices_from_env, parse_env, unknown_env)

__all__ = ['COMPRESSIONS', 'DIVISIBILITIES', 'ENV_VARS', 'EnvVar', 'FIELD_ENV', 'FORMER_ENV',
           'FORMER_FIELDS', 'FORMER_TRANSPORTS', 'LOCAL_STEPS_IN', 'LOCAL_WHEN_BUSY', 'MiB',
           'Options', 'RUNTIMES', 'Runtime', 'SNAPSHOTS', 'TIER_MAX_AGE_S', 'TIER_SCOPES',
           'TRANSPORTS', 'TransportName', 'env_raw', 'env_value', 'field_default',
           'former_transport', 'num_slices_from_env', 'parse_env', 'unknown_env']
