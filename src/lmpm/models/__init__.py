"""Built-in models, bound by name (see :mod:`lmpm.bindings`)."""
