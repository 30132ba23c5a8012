"""The data plane of training: one replica of the parameters, its data shard, its inner optimizer.

An epoch is one outer step. :meth:`TrainWorker.propose` starts from the committed parameters θ and
runs ``minimize`` lowered to autograd: H times (forward, backward, clip, optimizer step) on batches
drawn from the worker's shard; the inner optimizer's state stays on the worker across epochs. It
returns metadata only (:class:`Proposal`): the inner losses, tokens, and per parameter cell its
norm, checksum, and whether it changed. The control plane turns that into per-cell weights
(:func:`lmpm.train.policy.weights`); :meth:`contribution` is the worker's share of the weighted
mean of the candidates, Σ_w a_w·θ_w, which the workers all-reduce among themselves
(``torch.distributed``, never through the control plane), and :meth:`commit` applies the outer step
to it, identically on every worker:

- ``average`` / ``best``: θ ← Σ_w a_w·θ_w (the mean of the valid candidates, or the best one);
- ``diloco(lr, μ)``: g = θ − Σ_w a_w·θ_w (the mean pseudo-gradient), m ← μ·m + g,
  θ ← θ − lr·(g + μ·m) (Nesterov; ``nesterov=0``: θ ← θ − lr·m). With lr = 1 and μ = 0 this is
  θ ← Σ_w a_w·θ_w exactly (so DiLoCo with one worker and H = 1 *is* plain training).

Cells that no candidate may change (every candidate violated a constraint, or a freeze) keep θ and
their momentum. After the step, cells under a norm bound are projected onto it. Frozen cells are
also lowered: their tensors are left out of the inner optimizer (``requires_grad`` off), so
proposals never change them; the check still compares their checksums.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import time
import zlib
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lmpm.errors import ModelError
from lmpm.ir.link import link_training
from lmpm.train import modules
from lmpm.train.spec import TrainSpec


def ring_bytes(numel: int, world: int, itemsize: int = 4) -> int:
    """Bytes all W workers send in total for one ring all-reduce of ``numel`` elements."""
    return 2 * (world - 1) * numel * itemsize


def inner_path(params: Path, rank: int) -> Path:
    """Where worker ``rank`` keeps its inner state beside a parameters checkpoint:
    ``params-000003.safetensors`` → ``inner-w1-000003.pt``."""
    stem = params.name.removesuffix(".safetensors").replace("params", f"inner-w{rank}", 1)
    return params.with_name(stem + ".pt")


def select(names: list[str], patterns: tuple[str, ...]) -> list[int]:
    """The cells whose name matches one of the fnmatch ``patterns``."""
    return [i for i, n in enumerate(names) if any(fnmatchcase(n, p) for p in patterns)]


def shard_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Worker ``rank``'s contiguous slice [lo, hi) of ``rows`` rows."""
    return rows * rank // world, rows * (rank + 1) // world


def batch_generator(seed: int, rank: int, epoch: int) -> torch.Generator:
    """Counter-based: the batches of (seed, worker, epoch) do not depend on what ran before, so a
    respawned or resumed worker draws what the lost one would have."""
    return torch.Generator().manual_seed((seed * 1_000_003 + rank) * 1_000_003 + epoch)


@dataclass(frozen=True, slots=True)
class Proposal:
    """What a worker tells the control plane after its inner steps (metadata only)."""

    worker: int
    epoch: int
    losses: list[float]  # per inner step
    tokens: int
    seconds: float
    norms: list[float]  # per cell, of the candidate
    checksums: list[int]  # per cell (crc32 of the candidate's bytes)
    changed: list[bool]  # per cell: differs from the committed value
    eval_loss: float | None  # the rule's score on the candidate (held-out loss), if asked


@dataclass(frozen=True, slots=True)
class Committed:
    """A worker's report after the commit: the new θ's checksum (every worker must agree)."""

    worker: int
    epoch: int
    checksum: int
    projected: list[int]  # cells pulled back onto a norm bound
    eval_loss: float | None  # the score of the committed θ (worker 0, every eval_every epochs)


class TrainWorker:
    """One worker: ``rank`` of ``world``; ``data`` maps each data value to its full (rows, length)
    tensor, of which the worker keeps its shard; ``total_steps``: inner steps in the whole run
    (for the cosine schedule)."""

    def __init__(
        self,
        spec: TrainSpec,
        rank: int,
        world: int,
        data: dict[str, Tensor],
        *,
        total_steps: int,
        init: dict[str, Tensor] | None = None,
        threads: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if threads is not None:
            torch.set_num_threads(threads)
        # the device the module, its optimizer state and the data shards live on (the driver's
        # all-reduce and checkpoints read the host copies they need); `lmpm check --device cuda`
        # runs the inner loop there
        self.device = torch.device(device)
        self.spec = spec
        self.rank, self.world = rank, world
        rule = spec.rule
        torch.manual_seed(rule.seed)  # the same initial θ on every worker
        bound = link_training(spec)
        self.module = bound.module()
        if init is not None:
            self.module.load_state_dict(init)
        self.module.to(self.device)
        self.params = list(self.module.parameters())
        self.cells = modules.cells(self.module, spec.params.granularity)
        self.names = [n for n, _ in self.cells]
        self.loss = bound.loss
        self.eval = bound.eval_loss
        frozen: set[int] = set()
        self.norm_bounds: list[tuple[list[int], float]] = []
        for c in spec.constraints:
            idx = select(self.names, c.select)
            if c.kind == "freeze":
                frozen.update(idx)
            elif c.bound is not None:
                self.norm_bounds.append((idx, float(c.bound)))
        self.frozen = sorted(frozen)
        for ci in self.frozen:
            for pi in self.cells[ci][1]:
                self.params[pi].requires_grad_(False)
        trainable = [p for p in self.params if p.requires_grad]
        self.opt = _optimizer(rule.optimizer, trainable, rule)
        self.committed = [p.detach().clone() for p in self.params]
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.shards = []
        for d in rule.data:
            lo, hi = shard_rows(d.rows, rank, world)
            self.shards.append(data[d.name][lo:hi].to(self.device))
        self.held = [data[d.name].to(self.device) for d in rule.eval_data]
        self.total_steps = max(int(total_steps), 1)
        # the score of the committed θ costs a pass over the held-out rows: done every k epochs,
        # k such that it reads about as many rows as the epoch trained on (and at the last epoch)
        trained = max(rule.steps * rule.batch * world, 1)
        held = self.held[0].shape[0] if self.held else 0
        self.eval_every = max(1, -(-held // trained))
        self.last_epoch = self.total_steps // max(rule.steps, 1)
        self.step = 0  # inner steps taken (the schedule's clock)
        self.proposed: list[Tensor] | None = None

    # ---- propose ------------------------------------------------------------------------------------
    def _lr(self) -> float:
        r = self.spec.rule
        if r.warmup and self.step < r.warmup:
            return r.lr * (self.step + 1) / r.warmup
        if r.schedule == "cosine":
            f = 0.5 * (1 + math.cos(math.pi * self.step / self.total_steps))
            return r.lr * max(f, 0.02)
        return r.lr

    def propose(self, epoch: int, steps: int | None = None) -> Proposal:
        """Run the inner loop from the committed θ; ``steps`` overrides H (tests)."""
        rule = self.spec.rule
        t0 = time.perf_counter()
        with torch.no_grad():
            for p, c in zip(self.params, self.committed, strict=True):
                p.copy_(c)
        self.module.train()
        g = batch_generator(rule.seed, self.rank, epoch)
        losses: list[float] = []
        tokens = 0
        for _ in range(rule.steps if steps is None else steps):
            for grp in self.opt.param_groups:
                grp["lr"] = self._lr()
            batch = []
            for shard in self.shards:
                idx = torch.randint(0, shard.shape[0], (rule.batch,), generator=g)
                batch.append(shard[idx.to(self.device)])
            loss, n = self.loss(self.module, *batch)
            if not torch.isfinite(loss):
                raise ModelError(
                    f"the loss `{rule.loss}` is {loss.item()} at inner step {self.step}",
                    where={"rule": rule.rule, "worker": f"w{self.rank}", "epoch": epoch},
                    code="R070",
                    hint="lower lr, or add clip=1.0 to minimize(...)",
                )
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            if rule.clip is not None:
                torch.nn.utils.clip_grad_norm_(
                    [p for p in self.params if p.requires_grad], rule.clip
                )
            self.opt.step()
            losses.append(float(loss.detach()))
            tokens += n
            self.step += 1
        cand = [p.detach().clone() for p in self.params]
        self.proposed = cand
        norms: list[float] = []
        sums: list[int] = []
        changed: list[bool] = []
        for _, members in self.cells:
            ts = [cand[i] for i in members]
            norms.append(_norm(ts))
            sums.append(zlib.crc32(b"".join(t.cpu().numpy().tobytes() for t in ts)))
            changed.append(any(not torch.equal(cand[i], self.committed[i]) for i in members))
        ev = self.evaluate() if self.spec.policy.kind == "best" else None
        return Proposal(
            self.rank,
            epoch,
            losses,
            tokens,
            time.perf_counter() - t0,
            norms,
            sums,
            changed,
            ev,
        )

    def evaluate(self) -> float | None:
        """The rule's score loss of the module's current parameters on the whole held-out data."""
        if self.eval is None:
            return None
        self.module.eval()
        with torch.no_grad():
            total, n = 0.0, 0
            rows = self.held[0].shape[0]
            for lo in range(0, rows, 256):
                loss, k = self.eval(self.module, *(h[lo : lo + 256] for h in self.held))
                total += float(loss) * k
                n += k
        return total / max(n, 1)

    # ---- commit -------------------------------------------------------------------------------------
    def contribution(self, weights: list[float]) -> Tensor:
        """a_w·θ_w per cell, flattened: this worker's part of the all-reduced sum."""
        assert self.proposed is not None, "commit before propose"
        parts = []
        for (_, idx), a in zip(self.cells, weights, strict=True):
            for i in idx:
                t = self.proposed[i].reshape(-1)
                parts.append(t * a if a != 1.0 else t.clone())
        return torch.cat(parts)

    def commit(self, epoch: int, mean: Tensor, keep: list[bool]) -> Committed:
        """Apply the outer step with the all-reduced Σ_w a_w·θ_w; ``keep[c]``: cell c may change."""
        pol = self.spec.policy
        off = 0
        exact = pol.kind != "diloco" or (pol.outer_lr == 1.0 and pol.momentum == 0.0)
        with torch.no_grad():
            for (_, idx), may in zip(self.cells, keep, strict=True):
                for i in idx:
                    c = self.committed[i]
                    n = c.numel()
                    avg = mean[off : off + n].view_as(c)
                    off += n
                    if not may:
                        continue
                    if exact:
                        c.copy_(avg)
                        continue
                    grad = c - avg
                    m = self.momentum[i]
                    m.mul_(pol.momentum).add_(grad)
                    step = grad.add(m, alpha=pol.momentum) if pol.nesterov else m
                    c.sub_(step, alpha=pol.outer_lr)
            projected = []
            for idx, bound in self.norm_bounds:
                for ci in idx:
                    ts = [self.committed[i] for i in self.cells[ci][1]]
                    norm = _norm(ts)
                    if norm > bound:
                        for t in ts:
                            t.mul_(bound / norm)
                        projected.append(ci)
        self.proposed = None
        ev = None
        due = epoch % self.eval_every == 0 or epoch >= self.last_epoch
        if self.rank == 0 and self.eval is not None and due:
            with torch.no_grad():
                for p, c in zip(self.params, self.committed, strict=True):
                    p.copy_(c)
            ev = self.evaluate()
        return Committed(self.rank, epoch, self.checksum(), sorted(set(projected)), ev)

    def checksum(self) -> int:
        return zlib.crc32(b"".join(c.cpu().numpy().tobytes() for c in self.committed))

    # ---- state (checkpoints, a respawned worker) ----------------------------------------------------
    def state(self) -> dict[str, Tensor]:
        """The committed θ and the outer momentum, by parameter name (identical on every worker)."""
        names = [n for n, _ in self.module.named_parameters()]
        out = {f"param/{n}": c for n, c in zip(names, self.committed, strict=True)}
        out.update({f"momentum/{n}": m for n, m in zip(names, self.momentum, strict=True)})
        return out

    def load_state(self, state: dict[str, Tensor], step: int) -> None:
        names = [n for n, _ in self.module.named_parameters()]
        with torch.no_grad():
            for n, c, m in zip(names, self.committed, self.momentum, strict=True):
                c.copy_(state[f"param/{n}"])
                m.copy_(state[f"momentum/{n}"])
        self.step = step

    def save_inner(self, path: Path) -> str:
        """This worker's inner optimizer state and schedule step (for an exact resume or redo);
        the file's sha256, which the parameters checkpoint records."""
        from lmpm.runtime.lock import atomic_write

        buf = io.BytesIO()
        torch.save({"opt": self.opt.state_dict(), "step": self.step}, buf)
        data = buf.getvalue()
        atomic_write(path, data)
        return hashlib.sha256(data).hexdigest()

    def load_inner(self, path: Path, sha: str | None = None) -> bool:
        """Load what :meth:`save_inner` wrote, checked against ``sha`` (its sha256 as the
        parameters checkpoint recorded it; None for a checkpoint from before it did); False (a
        fresh inner optimizer) when it is missing. A regular file only, read whole once
        (:func:`~lmpm.runtime.runfiles.read_file`); a damaged one is RunDirError D021."""
        from lmpm.errors import RunDirError
        from lmpm.runtime.runfiles import read_file

        try:
            data = read_file(path.parent, path.name)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise RunDirError(f"cannot read {path}: {e.strerror}", code="D021") from None
        if sha is not None and hashlib.sha256(data).hexdigest() != sha:
            raise RunDirError(
                f"{path} does not match its checksum in the parameters checkpoint (altered or "
                "damaged)",
                code="D021",
                hint="restore the run directory from a copy, or start the run over (--force)",
            )
        try:
            st = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            self.opt.load_state_dict(st["opt"])
            self.step = int(st["step"])
        except Exception as e:
            raise RunDirError(
                f"{path} is not this worker's inner optimizer state ({type(e).__name__}: {e})",
                code="D021",
                hint="restore the run directory from a copy, or start the run over (--force)",
            ) from None
        return True

    def numel(self) -> int:
        return sum(c.numel() for c in self.committed)

    def pid(self) -> int:
        return os.getpid()


def _norm(ts: list[Tensor]) -> float:
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in ts))


def _optimizer(name: str, params: list[Any], rule: Any) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=rule.lr, weight_decay=rule.weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=rule.lr, weight_decay=rule.weight_decay)
    return torch.optim.SGD(
        params, lr=rule.lr, momentum=rule.momentum, weight_decay=rule.weight_decay
    )
