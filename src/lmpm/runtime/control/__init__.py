"""The control plane: the epoch barrier, the RuleSet, termination, and the run's durable record.

``engine`` runs epochs through the one port (:mod:`lmpm.runtime.port`) and never holds payload or
per-cell state; ``commitlog`` and ``trace`` are its observers (the run directory's log, the
constraint trace); ``crdt`` holds the replicated sets it keeps (MaskPlan, RuleSet).
"""
