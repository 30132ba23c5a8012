"""Training as consensus: ``Params`` values, ``minimize`` proposals lowered to autograd, DiLoCo.

See ``docs/training.md``. :mod:`lmpm.train.spec` is what a training program asks for,
:mod:`lmpm.train.log` the run's log (read by ``lmpm top`` and ``lmpm render``).
"""
