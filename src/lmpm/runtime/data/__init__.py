"""The data plane: the workers that hold the payload and the owners that decide their cells.

``dataplane`` is one worker (and, under ``--compile``, a fused one: ``compiled``); ``owner``
decides its cells (``agree``, ``clocks``); ``group`` and ``raygroup`` are W workers in this
process or as Ray actors, the halo moving over ``transport``; ``store`` is a worker's durable
payload; ``guard`` checks that no payload crosses the port.
"""
