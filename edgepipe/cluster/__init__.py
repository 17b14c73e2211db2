"""The control plane: the coordinator, in four layers that import only downward.

``state`` (the cluster as data, changed only by events through one ``apply``) → ``rules`` (the
decisions, pure functions of the state) → ``shells`` (the asyncio I/O that carries them out and
feeds what happens back as events) → ``simulation`` (the shipped shells on fake ports, seeded
fault schedules and their invariants). ``tests/test_layers.py`` checks the direction."""
