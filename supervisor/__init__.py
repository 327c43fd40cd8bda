"""clonemap supervisor: config, placement, spawn/watch/restart, and the MDP/0.2 broker.

Not PyPI's ``supervisor`` (supervisord): clonemap never depends on that package, and the
two must not be installed into the same environment.
"""
