"""The token-stream VM: workflows compiled to instruction tensors, run for many streams at once.

A ``workflow`` (see ``docs/vm.md``) is compiled by :func:`compile_workflow` into parallel tensors,
one row per zone; :class:`VM` keeps a program counter, a token counter and a trigger ring per
stream and moves all of them with tensor ops each step; :class:`WorkflowRun` drives it with the
program's model, its constraints and the commit log.
"""

from lmpm.vm.compile import ByteTokenizer, Instructions, compile_workflow, instructions_text
from lmpm.vm.core import FORCED, GENERATED, TOOL, Core, Forced, Sampler, StepOut
from lmpm.vm.machine import VM
from lmpm.vm.runner import WorkflowRun

__all__ = [
    "FORCED",
    "GENERATED",
    "TOOL",
    "VM",
    "ByteTokenizer",
    "Core",
    "Forced",
    "Instructions",
    "Sampler",
    "StepOut",
    "WorkflowRun",
    "compile_workflow",
    "instructions_text",
]
