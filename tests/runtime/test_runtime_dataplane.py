"""The split between the planes: payload never reaches the control plane (a guard checks every
example), user code cannot change state through its inputs, Tensor[D] values end to end, and the
messages' size does not depend on the payload's width."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lmpm.errors import ModelError
from lmpm.models import world
from lmpm.resolve import policies
from lmpm.resolve.policies import Agree, Decision
from lmpm.runtime.control.engine import Engine
from lmpm.runtime.data.guard import GuardedDataPlane, PayloadLeak, check_message
from lmpm.runtime.protocol import nbytes
from lmpm.runtime.session import Run

ROOT = Path(__file__).resolve().parents[2]
EX = ROOT / "examples"
SMALL_VIDEO = {"T": 2, "W": 16, "H": 16, "x1": 4, "x2": 11, "y1": 8, "y2": 13}


def _latent_input(tmp: Path, w: int = 6, h: int = 5, d: int = 32) -> Path:
    z = np.random.default_rng(0).normal(size=(w, h, d)).astype(np.float32) * 0.3
    path = tmp / f"z{d}.npy"
    np.save(path, z)
    return path


def _video_patch(tmp: Path) -> Path:
    scene = world.render(world.demo_scene(2, 16, 16)).numpy()
    p = np.full_like(scene, -1)
    p[:, 4:12, 8:14] = scene[:, 4:12, 8:14]
    path = tmp / "patch.npy"
    np.save(path, p)
    return path


def _examples(tmp: Path) -> dict[str, tuple[Path, dict[str, Any], dict[str, str], int]]:
    """name -> (program, params, inputs, epochs): every shipped example the engine runs, at a
    small size (examples/vm.lmpm runs on the VM, examples/train_bytelm.lmpm on the trainer)."""
    video_in = {"Txt": str(EX / "video" / "caption.txt"), "Vid": str(_video_patch(tmp))}
    return {
        "gpt": (EX / "gpt.lmpm", {"N": 12}, {}, 4),
        "text": (EX / "text.lmpm", {}, {"Txt": str(EX / "text" / "prompt.txt")}, 3),
        "text_free": (EX / "text_free.lmpm", {}, {"Txt": str(EX / "text" / "prompt.txt")}, 3),
        "video": (EX / "video.lmpm", SMALL_VIDEO, video_in, 3),
        "video_free": (EX / "video_free.lmpm", SMALL_VIDEO, {"Txt": video_in["Txt"]}, 2),
        "sudoku": (EX / "sudoku.lmpm", {}, {"Grid": str(EX / "sudoku" / "puzzle.json")}, 4),
        "latent": (EX / "latent.lmpm", {"W": 6, "H": 5}, {"Z": str(_latent_input(tmp))}, 4),
        "latent256": (
            EX / "latent.lmpm",
            {"W": 6, "H": 5, "D": 256},
            {"Z": str(_latent_input(tmp, d=256))},
            3,
        ),
    }


ENGINE_EXAMPLES = [
    "gpt",
    "text",
    "text_free",
    "video",
    "video_free",
    "sudoku",
    "latent",
    "latent256",
]


@pytest.mark.parametrize("name", ENGINE_EXAMPLES)
def test_every_example_runs_with_payload_kept_off_the_control_plane(
    name: str, tmp_path: Path
) -> None:
    prog, params, inputs, epochs = _examples(tmp_path)[name]
    guarded = Run.from_file(prog, params=params, inputs=inputs, seed=3, guard=True)
    assert isinstance(guarded.dataplane, GuardedDataPlane)
    guarded.run(epochs)
    plain = Run.from_file(prog, params=params, inputs=inputs, seed=3)
    plain.run(epochs)
    # the guard changes nothing: same commits, clocks, provenance
    for value in plain.plan.values:
        a, b = guarded.engine.state[value], plain.engine.state[value]
        for f in ("committed", "clock", "rule", "epoch"):
            assert torch.equal(getattr(a, f), getattr(b, f)), (value, f)
        assert torch.equal(guarded.payload(value), plain.payload(value)), value


def test_the_guard_catches_payload_on_the_control_plane(tmp_path: Path) -> None:
    prog, params, inputs, _ = _examples(tmp_path)["latent"]
    run = Run.from_file(prog, params=params, inputs=inputs, guard=True)
    leaked = run.dataplane.payload["Z"][:3]  # what a control plane that peeked would hold
    with pytest.raises(PayloadLeak, match="payload tensor"):
        check_message({"record": leaked}, "test")

    class Peek:  # an observer that reads the worker's payload while an epoch runs
        def on_start(self, engine: Engine) -> None: ...
        def on_epoch(self, engine: Engine, record: Any) -> None:
            engine.dataplane.read("Z")

        def on_end(self, engine: Engine) -> None: ...

    run.engine.observers.append(Peek())
    with pytest.raises(PayloadLeak, match="read while the control plane ran"):
        run.run(1)


WIDE = """
value V : {type} shape Grid2D(6, 5)
value MaskPlan : Event shape Set()
visible V[x, y] <- V[x+dx, y+dy] when (dx,dy) in N4
rule R:
  on V[x, y]
  read {nb in N4}
  emit proposal V[x, y] := Fixed(nb, k=3)
constraint Odd: forbid Odd(V[x, y]) priority 2
commit V[*] using {policy}
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


def _fixed(inputs: dict[str, torch.Tensor], *, k: int, epoch: int, **kw: Any) -> Any:
    """Candidate j of a cell is the number (c + j + e) % 5, as a token or as a vector of it;
    scores depend on the cell only: the same decisions whatever the payload's width."""
    cells = inputs["cells"]
    j = torch.arange(k)
    num = (cells[:, None] + j[None, :] + epoch) % 5  # (n, k)
    score = -((cells[:, None] * 7 + j[None, :] * 3) % 4).double()
    if kw.get("vocab") is not None:
        return {"proposal": num, "score": score}
    return {"proposal": num[:, :, None].float().expand(-1, -1, 256).clone(), "score": score}


def _odd(ctx: Any) -> torch.Tensor:
    c = ctx.candidates if ctx.candidates.dim() == 2 else ctx.candidates[:, :, 0]
    return c.long() % 2 == 1


@pytest.mark.parametrize("policy", ["satisfy", "quorum(1, satisfy)"])
def test_control_plane_bytes_do_not_depend_on_the_payload_width(policy: str) -> None:
    sizes: dict[str, list[int]] = {}
    for typ in ("Token[16]", "Tensor[256]"):
        run = Run.from_source(
            WIDE.replace("{type}", typ).replace("{policy}", policy),
            bindings={"Fixed": _fixed, "Odd": _odd},
            seed=1,
        )
        sent: list[int] = []
        dp = run.dataplane
        propose, apply = dp.propose, dp.apply

        def p(req: Any, _f: Any = propose, _s: list[int] = sent) -> Any:
            out = _f(req)
            _s.append(nbytes(req) + nbytes(out))
            return out

        def a(req: Any, _f: Any = apply, _s: list[int] = sent) -> Any:
            out = _f(req)
            _s.append(nbytes(req) + nbytes(out))
            return out

        dp.propose, dp.apply = p, a  # type: ignore[method-assign]
        run.run(4)
        sizes[typ] = sent
    assert sizes["Token[16]"] == sizes["Tensor[256]"] and sum(sizes["Token[16]"]) > 0


# ---- inputs are read-only by construction ---------------------------------------------------------
GRID = """
value A : Token[7] shape Grid2D(4, 3)
value MaskPlan : Event shape Set()
visible A[x, y] <- A[x+dx, y+dy] when (dx,dy) in N4
rule R:
  on A[x, y]
  read {nb in N4}
  emit proposal A[x, y] := Echo(nb, k=3)
  score S(...)
constraint Low: forbid A[x, y] in Set(5, 6) priority 5
constraint Pair: forbid Same(A[x, y], A[x+1, y]) priority 3
commit A[*] using {policy}
rule Schedule:
  on MaskPlan
  emit proposal MaskPlan := SampleTiles(strategy="red-black", epoch=e)
"""


def _echo(inputs: dict[str, torch.Tensor], *, vocab: int, k: int = 3, epoch: int = 0, **_: Any):
    total = inputs["cells"] + torch.where(inputs["nb_mask"], inputs["nb"], 0).sum(dim=1)
    j = torch.arange(int(k))
    prop = (total[:, None] + j[None, :] + epoch) % vocab
    return {"proposal": prop, "score": -((prop * 5 + 1) % 7).double()}


def _score(inputs: dict[str, torch.Tensor], **_: Any) -> torch.Tensor:
    return -((inputs["proposal"] * 3 + 2) % 5).double()


def _same(ctx: Any) -> torch.Tensor:
    data, mask, _ = ctx.accesses[0]
    return ((ctx.candidates[:, :, None] == data[:, None, :]) & mask[:, None, :]).any(dim=2)


def _vandal(fn: Any) -> Any:
    """``fn``, which then writes garbage into every tensor it was given."""

    def wrecked(inputs: Any, **kw: Any) -> Any:
        out = fn(inputs, **kw)
        for t in list(inputs.values()) if isinstance(inputs, dict) else []:
            if isinstance(t, torch.Tensor) and t.numel():
                try:
                    t.fill_(3) if t.dtype != torch.bool else t.fill_(False)
                except RuntimeError:
                    pass  # an expanded (broadcast) view cannot be written
        return out

    return wrecked


def _vandal_predicate(ctx: Any) -> torch.Tensor:
    out = _same(ctx)
    for t in (ctx.candidates, ctx.valid, ctx.current, ctx.committed, ctx.cells, ctx.coords):
        t.fill_(1) if t.dtype != torch.bool else t.fill_(True)
    for data, mask, index in ctx.accesses:
        data.fill_(2)
        mask.fill_(True)
        index.fill_(0)
    return out


def _vandal_policy(a: Agree, *args: Any) -> Decision:
    d = policies.satisfy(a, *args)
    for t in (a.valid, a.score, a.violated, a.levels.key, a.rule, a.replica, a.slot):
        if t is None:
            continue
        t.fill_(0) if t.dtype != torch.bool else t.fill_(True)
    return d


def _final(model: Any, score: Any, pred: Any, policy: str) -> dict[str, Any]:
    policies.register("vandal")(_vandal_policy)
    policies.register("plain")(lambda a, *args: policies.satisfy(a, *args))
    run = Run.from_source(
        GRID.replace("{policy}", policy),
        bindings={"Echo": model, "S": score, "Same": pred},
        seed=2,
    )
    run.run(6)
    st = run.engine.state["A"]
    return {
        "payload": run.payload("A").tolist(),
        "clock": st.clock.tolist(),
        "rule": st.rule.tolist(),
        "epoch": st.epoch.tolist(),
    }


@pytest.mark.parametrize("who", ["model", "score", "predicate", "policy"])
def test_user_code_that_writes_into_its_inputs_changes_nothing(who: str) -> None:
    clean = _final(_echo, _score, _same, "plain")
    got = _final(
        _vandal(_echo) if who == "model" else _echo,
        _vandal(_score) if who == "score" else _score,
        _vandal_predicate if who == "predicate" else _same,
        "vandal" if who == "policy" else "plain",
    )
    assert got == clean


# ---- Tensor[D] values -----------------------------------------------------------------------------
def test_tensor_values_constraints_average_and_outputs(tmp_path: Path) -> None:
    z0 = _latent_input(tmp_path)
    run = Run.from_file(EX / "latent.lmpm", params={"W": 6, "H": 5}, inputs={"Z": str(z0)}, seed=0)
    run.run(6)
    z = run.payload("Z")
    assert z.shape == (30, 32)
    assert float(z.norm(dim=1).max()) <= 3.0 + 1e-5  # Bounded held on every commit
    # M = mean of Copy (the cell's Z) and BoxMean (the mean of its 3x3 box) at the epoch it ran
    out = run.outputs()
    assert out["Z"].shape == (6, 5, 32) and out["M"].shape == (6, 5, 32)
    assert not np.isnan(out["M"]).any()
    # the model alone (no constraint) would have grown the vectors past the bound
    free = Run.from_source(
        (EX / "latent.lmpm")
        .read_text()
        .replace("require NormAtMost", "require NormAtMost")
        .replace("priority 10", "priority 10")
        .replace("constraint Bounded:\n  require NormAtMost(Z[x, y], R) priority 10\n", ""),
        params={"W": 6, "H": 5},
        inputs={"Z": str(z0)},
        seed=0,
    )
    free.run(6)
    assert float(free.payload("Z").norm(dim=1).max()) > 3.0


def test_average_is_computed_by_the_worker() -> None:
    src = """
value F : Float shape Seq(4)
rule A:
  on F[i]
  emit proposal F[i] := Const(v=1)
rule B:
  on F[i]
  emit proposal F[i] := Const(v=4)
commit F[*] using average
"""

    def const(inputs: dict[str, torch.Tensor], *, v: int, **_: Any) -> dict[str, torch.Tensor]:
        n = inputs["cells"].shape[0]
        return {"proposal": torch.full((n,), float(v)), "score": torch.zeros(n)}

    run = Run.from_source(src, bindings={"Const": const})
    res = run.run(3)
    assert run.payload("F").tolist() == [2.5] * 4
    assert res.commits == 4  # the second epoch's average equals the committed value: no commit


def test_a_proposal_of_the_wrong_shape_names_its_rule(tmp_path: Path) -> None:
    src = """
value Z : Tensor[8] shape Seq(3)
rule Bad:
  on Z[i]
  emit proposal Z[i] := Flat()
"""

    def flat(inputs: dict[str, torch.Tensor], **_: Any) -> dict[str, torch.Tensor]:
        n = inputs["cells"].shape[0]
        return {"proposal": torch.zeros(n, 2, 5), "score": torch.zeros(n, 2)}

    run = Run.from_source(src, bindings={"Flat": flat})
    with pytest.raises(ModelError, match=r"rule `Bad` proposed a tensor of shape \(3, 2, 5\)"):
        run.run(1)


def test_tensor_values_resume_exactly_after_sigkill(tmp_path: Path) -> None:
    z0 = _latent_input(tmp_path)
    lmpm = [sys.executable, "-m", "lmpm"]  # the `lmpm` command
    common = ["--input", f"Z={z0}", "--set", "W=6", "--set", "H=5", "--seed", "4", "--quiet"]
    prog = str(EX / "latent.lmpm")
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    ok = subprocess.run([*lmpm, "run", prog, *common, "--epochs", "9", "--out", str(ref)])
    assert ok.returncode == 0
    first = subprocess.run(
        [*lmpm, "run", prog, *common, "--epochs", "5", "--checkpoint-every", "2", "--out", str(cut)]
    )
    assert first.returncode == 0
    again = subprocess.run(
        [*lmpm, "run", "--resume", str(cut), "--epochs", "9", "--quiet"], capture_output=True
    )
    assert again.returncode == 0, again.stderr.decode()
    for name in ("Z.npy", "M.npy"):
        assert (cut / name).read_bytes() == (ref / name).read_bytes(), name


def test_a_kept_read_of_an_input_value_follows_every_change_to_it() -> None:
    """LMPM's own models get a read of all of an input-only value's cells (the video's caption)
    kept between epochs; a new input, a reload or a halo write must show in the next read."""
    run = Run.from_file(
        EX / "video.lmpm",
        params={"T": 1, "W": 8, "H": 8, "x1": 0, "x2": 1, "y1": 0, "y2": 1},
        inputs={"Txt": str(EX / "video" / "caption.txt")},
        seed=0,
    )
    dp = run.dataplane
    rp = next(r for r in run.plan.rules if r.name == "CoarsePlan")
    cells = torch.arange(1)
    first = dp.inputs.gather(rp, cells)["txt"]
    again = dp.inputs.gather(rp, cells)["txt"]
    assert again.data_ptr() == first.data_ptr()  # kept: nothing changed
    n = run.plan.values["Txt"].ncells
    new = torch.arange(n) % 7 + 97
    dp.set_input("Txt", new, torch.ones(n, dtype=torch.bool))
    assert dp.inputs.gather(rp, cells)["txt"][0].tolist() == new.tolist()
    dp.payload["Txt"].index_copy_(0, torch.tensor([3]), torch.tensor([120]))  # a halo write
    assert int(dp.inputs.gather(rp, cells)["txt"][0, 3]) == 120
    dp.committed["Txt"].index_fill_(0, torch.tensor([5]), False)
    assert not bool(dp.inputs.gather(rp, cells)["txt_mask"][0, 5])
    dp.load(
        "Txt",
        torch.full((n,), 98),
        torch.ones(n, dtype=torch.bool),
        torch.ones(n, dtype=torch.bool),
    )
    assert dp.inputs.gather(rp, cells)["txt"][0].tolist() == [98] * n


@pytest.mark.parametrize("n", [1, 3])
def test_pick_takes_each_rows_winning_column(n: int) -> None:
    from lmpm.runtime.data.owner import pick

    table = torch.arange(4 * n * 5, dtype=torch.float64).reshape(n, 5, 4)[:, :, 1]  # strided
    winner = torch.tensor([4, 0, 2][:n])
    assert pick(table, winner).tolist() == [table[i, w].item() for i, w in enumerate(winner)]
