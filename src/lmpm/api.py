"""`lmpm.compile`: one object for a program bound to parameters — its IR, masks, and runs.

>>> import lmpm
>>> prog = lmpm.compile(text="value Txt : Token[Byte] shape Seq(N)\\nvisible Txt[t] <- Txt[0..t-1] when t > 0\\n", N=4)
>>> prog.masks(layout="raster").dense().int().tolist()
[[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmpm.bindings import Bindings
from lmpm.ir import Frontend, compile_file, compile_source
from lmpm.ir.nodes import Program

if TYPE_CHECKING:
    from lmpm.runtime.session import Run
    from lmpm.visibility import Masks


@dataclass(frozen=True)
class Compiled:
    """A checked program with its parameter bindings (``--set``), the names it was checked
    against (``bind=``, ``bindings=``: its runs bind them) and the tokenizers of its vocabularies
    (``tokenizers=``, as ``--tokenizer``: their sizes are in ``params``; its runs bind them)."""

    front: Frontend
    params: dict[str, int] = field(default_factory=dict)
    bindings: Bindings = field(default_factory=Bindings, compare=False)
    text: str | None = field(default=None, compare=False, repr=False)  # None: read the file
    tokenizers: dict[str, str] = field(default_factory=dict)  # NAME of Token[NAME] -> its path

    @property
    def ir(self) -> Program:
        return self.front.ir

    def masks(self, layout: str = "auto") -> Masks:
        """Attention masks, BlockMasks and gather tables compiled from the `visible` clauses."""
        from lmpm.visibility import masks

        return masks(self.ir, self.params, layout)

    def runner(self, *, run_dir: str | Path | None = None, **options: Any) -> Run:
        """A :class:`lmpm.runtime.session.Run` with keyword ``options``, the fields of
        :class:`lmpm.runtime.config.RunConfig` (``bindings=``, ``inputs=``, ``seed=``,
        ``epochs=``, ``backend=``, ``bind=``, ``compile=``, ``workers=``...), checked as `lmpm run`
        checks before epoch 0. It binds what :func:`compile` was given, and ``bind=``/``bindings=``
        (and ``tokenizers=``) given here on top. With ``run_dir=`` every epoch goes to RUN_DIR/lmpm.db by the same path
        as `lmpm run --out RUN_DIR` (``trace=`` off/summary/cells, ``trace_region=``,
        ``checkpoint_every=``, ``durable=``, ``force=``; a run there that failed before its first
        epoch is replaced), and the outputs are written there when the run ends
        (``finish()``); `lmpm trace RUN_DIR` and ``lmpm.resume(RUN_DIR)`` read it."""
        from lmpm.runtime.config import RunConfig
        from lmpm.runtime.session import Run

        tokenizers = {**self.tokenizers, **dict(options.pop("tokenizers", None) or {})}
        cfg = RunConfig(params=self.params, tokenizers=tokenizers).replace(**options)
        loaded = self.bindings
        if cfg.bind or cfg.bindings:
            loaded = loaded.extended(cfg.bind, dict(cfg.bindings or {}))
        run = Run(self.front, cfg.replace(bind=(), bindings=loaded))
        if run_dir is not None:
            try:
                run.log_to(run_dir, source=self.source)
            except BaseException:
                run.close()
                raise
        return run

    @property
    def source(self) -> str:
        """The program text, as compiled (what a run's log stores, as `lmpm run` stores it)."""
        if self.text is not None:
            return self.text
        return Path(self.front.ast.file).read_text(encoding="utf-8")


def compile(
    path: str | Path | None = None,
    /,
    *,
    text: str | None = None,
    file: str = "<input>",
    bind: Sequence[str] = (),
    bindings: Mapping[str, Any] | None = None,
    tokenizers: Mapping[str, str | Path] | None = None,
    **params: int,
) -> Compiled:
    """Compile a program with parameters bound: ``compile("prog.lmpm", N=64)`` reads a file,
    ``compile(text="value ...")`` compiles program text (``file=`` names it in diagnostics).

    ``bind=[MODULE, ...]`` and ``bindings={"Name": obj}`` are the names its runs bind, as `lmpm run
    --bind` takes them: the program is checked against them (a name bound here that a built-in
    also has is held to its own Python signature, not the built-in's) and ``runner()`` binds
    them::

        prog = lmpm.compile("prog.lmpm", bindings={"Copy": my_copy})
        run = prog.runner(run_dir="runs/mine")

    ``tokenizers={"NAME": PATH}`` binds the vocabulary NAME of ``Token[NAME]`` to a tokenizer (a
    ``tokenizer.json`` or a Hugging Face model directory holding one), as `lmpm run --tokenizer
    NAME=PATH`: its size becomes the parameter NAME (B090-B094 when it cannot), and ``runner()``
    reads and writes that value's text with it::

        prog = lmpm.compile("chat.lmpm", tokenizers={"GPT2": "models/gpt2"})
        run = prog.runner(inputs={"Txt": "prompt.txt"}, bind=["my_hf_models"])
    """
    from lmpm.errors import UsageError

    if (path is None) == (text is None):
        raise UsageError("give lmpm.compile() a path or text=..., not both or neither", code="U044")
    loaded = Bindings(bind, dict(bindings or {}))
    bound = loaded.user_names()
    toks = {str(k): str(v) for k, v in (tokenizers or {}).items()}
    if text is not None:
        params = _sized(
            lambda o: compile_source(text, file, overrides=o, raise_errors=False), toks, params
        )
        front = compile_source(text, file, overrides=params, bound_names=bound)
        return Compiled(front, dict(params), loaded, text, toks)
    p = Path(path)  # type: ignore[arg-type]  # not None here
    if "\n" in str(path) or not p.is_file():
        what = "looks like program text" if "\n" in str(path) else "is not a file"
        raise UsageError(
            f"lmpm.compile({_short(str(path))!r}): the path {what}",
            code="U045",
            hint="pass program text as lmpm.compile(text=...)",
        )
    params = _sized(lambda o: compile_file(p, overrides=o, raise_errors=False), toks, params)
    front = compile_file(p, overrides=params, bound_names=bound)
    return Compiled(front, dict(params), loaded, p.read_text(encoding="utf-8"), toks)


def _sized(
    front: Callable[[dict[str, int]], Frontend],
    tokenizers: Mapping[str, str],
    params: dict[str, int],
) -> dict[str, int]:
    """``params`` with each tokenizer's vocabulary size, as `lmpm check --tokenizer` sizes them
    (``front``: the program checked with some parameters; nothing is loaded without tokenizers)."""
    if not tokenizers:
        return params
    from lmpm.runtime.vocab import bind_vocabularies

    return bind_vocabularies(front(params).ir, tokenizers, params)[1]


def resume(
    run_dir: str | Path,
    *,
    epochs: int | None = None,
    backend: str | None = None,
    compile: bool = False,
    bind: Sequence[str] | None = None,
    bindings: Mapping[str, Any] | None = None,
    trust_bind: bool = False,
    **options: Any,
) -> Run:
    """Continue the run in ``run_dir`` (written by `lmpm run --out` or ``runner(run_dir=...)``)
    from its last complete epoch, with the settings it was started with: what
    `lmpm run --resume RUN_DIR` does, by the same path (``compile=True``: the compiled epoch step,
    as `--compile`). A run started with bound modules needs ``bind=[...]`` naming them again (as
    it was started), or ``trust_bind=True`` to import what the run directory names; a run started
    with ``bindings={...}`` needs them again (the same names with the same Python signatures, as
    the run recorded them; a ``bind=`` module binding them will do too). Other ``options`` are
    the fields of :class:`lmpm.runtime.config.ResumeRequest` (``until=``, ``durable=``,
    ``driver=``, ``worker_timeout=``...). Call ``.run()`` on the result, then ``.finish()``::

        run = lmpm.resume("runs/mine", epochs=30, bindings={"Neighbours": neighbours})
        run.run(run.epochs)
        run.finish()
    """
    from lmpm.runtime.config import ResumeRequest
    from lmpm.runtime.session import resume as _resume

    request = ResumeRequest.of(
        epochs=epochs,
        backend=backend,
        compile=compile,
        bind=bind,
        bindings=bindings,
        trust_bind=trust_bind,
        **options,
    )
    return _resume(run_dir, request=request)


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."
