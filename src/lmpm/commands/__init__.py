"""Subcommands of `lmpm`, one module each; see :mod:`lmpm.cli`."""
