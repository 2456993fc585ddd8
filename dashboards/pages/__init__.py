"""One module per page: ``PATH``, ``TITLE``, ``layout(ctx)`` and ``register(app, ctx)``."""
