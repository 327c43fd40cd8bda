"""clonemap supervisor: config, placement, spawn/watch/restart, and the MDP/0.2 broker.

Not PyPI's ``supervisor`` (supervisord): clonemap never depends on that package. Its
dependencies are the ``server`` extra (``pip install 'clonemap[server]'``); without them,
importing this package says so (``MissingExtra``).
"""
from clonemap.shards.common.errors import SERVER_MODULES, require_extra

require_extra("the supervisor", "server", SERVER_MODULES)
