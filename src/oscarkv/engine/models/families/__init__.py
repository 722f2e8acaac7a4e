"""One module per architecture family, each a :class:`~..registry.Family` named ``FAMILY``."""
