"""LMPM: a language and runtime for consensual programming over PyTorch.

>>> import lmpm
>>> front = lmpm.check_source("value Txt : Token[Byte] shape Seq(8)\\nvisible Txt[t] <- Txt[0..t-1] when t > 0\\n")
>>> [v.name for v in front.ir.values]
['Txt']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmpm.api import Compiled as Compiled
from lmpm.api import compile as compile
from lmpm.api import resume as resume
from lmpm.bindings import bind as bind
from lmpm.errors import BindError as BindError
from lmpm.errors import CheckError as CheckError
from lmpm.errors import LmpmError as LmpmError
from lmpm.errors import ModelError as ModelError
from lmpm.errors import ParseError as ParseError
from lmpm.errors import RuntimeFault as RuntimeFault
from lmpm.ir import Frontend as Frontend
from lmpm.ir import compile_file as check_file
from lmpm.ir import compile_source as check_source
from lmpm.runtime.config import RunConfig as RunConfig
from lmpm.runtime.records import PredicateInput as PredicateInput
from lmpm.version import __version__ as __version__

if TYPE_CHECKING:
    from lmpm.runtime.session import Run as Run
    from lmpm.workers.base import Logits as Logits


def __getattr__(name: str) -> Any:
    """``lmpm.Logits`` and ``lmpm.Run`` on first use: importing them imports torch, which the
    CLI's light commands (``lmpm check``, ``lmpm trace``) never do."""
    if name == "Logits":
        from lmpm.workers.base import Logits

        return Logits
    if name == "Run":
        from lmpm.runtime.session import Run

        return Run
    raise AttributeError(f"module 'lmpm' has no attribute {name!r}")


__all__ = [
    "BindError",
    "CheckError",
    "Compiled",
    "Frontend",
    "LmpmError",
    "Logits",
    "ModelError",
    "ParseError",
    "PredicateInput",
    "Run",
    "RunConfig",
    "RuntimeFault",
    "__version__",
    "bind",
    "check_file",
    "check_source",
    "compile",
    "resume",
]
