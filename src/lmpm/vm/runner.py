from __future__ import annotations


class WorkflowRun:
    pass
