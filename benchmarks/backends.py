"""Claim: one batched LMPM dispatch beats a per-object / per-module loop.

Prints one JSON line per workload, baseline and LMPM measured in the same process, outputs checked
equal before any number is printed:

- ``monty``: Monty's evidence update of its hypotheses (L learning modules x O object graphs x H
  hypotheses), as its default hypotheses displacer does it: displace each hypothesis by the
  pose-rotated sensor displacement, find its K=3 nearest graph nodes, distance stretched along the
  surface normal, pose evidence from the angles between sensed and stored surface normals and
  curvature directions, feature evidence (hsv, curvatures) within tolerances, -1 for nodes beyond
  max_match_distance, max over the K nodes, past/present weights. Baseline: the way Monty runs it
  today — a Python loop over modules, inside it one thread per object graph (ThreadPoolExecutor),
  numpy + one ``scipy.spatial.cKDTree`` per graph. LMPM: one dispatch on the CPU backend, one model
  call for every (module, object) cell: one KD-tree query for all hypotheses (a joint tree over
  all graphs), the evidence as batched torch ops. Goal >= 5x.
- ``small_model``: O objects x a small MLP; per-object ``model(x_i)`` loop vs one dispatch. Goal >= 20x.
- ``cuda``: the Monty update on ``--device`` (the GPU path: every tensor of the model on the device,
  the nearest nodes found by a torch search instead of the KD-tree, no numpy, no host round trip)
  against Monty's per-object loop on the CPU of the same machine; outputs checked equal first. Also
  the time ``dispatch`` holds the caller against the whole update, whether the work still ran when
  it returned, and (CUDA) how many host-device synchronisations it made. Goal >= 20x on a GPU.
  ``--device cpu`` runs the same code on the cpu backend: a dry run of the GPU path, same JSON line
  (``dry_run: true``); ``--device cuda`` without a GPU prints a skipped line.

Run: ``PYTHONPATH=src python benchmarks/backends.py [--scale 0.5] [--threads 2] [--repeat 3]
[--compile] [--only monty|small_model|cuda] [--device cpu|cuda]``; on a GPU:
``--only cuda --device cuda``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from scipy.spatial import cKDTree
from torch import Tensor

from lmpm.workers import Backend, Ref, WorkItem, get_backend

# Monty's DefaultHypothesesDisplacer defaults (tbp.monty evidence matching), the values used here.
MAX_MATCH_DISTANCE = 0.01  # metres: nodes farther than this from a search location give no evidence
MAX_NNEIGHBORS = 3  # nearest graph nodes looked at per hypothesis
PAST_WEIGHT = 1.0
PRESENT_WEIGHT = 1.0
FEATURE_EVIDENCE_INCREMENT = 1.0
POSE_WEIGHTS = (1.0, 1.0)  # surface normal, first principal curvature direction
# Non-pose features: hsv (hue is circular) + two log principal curvatures.
TOLERANCES = np.array([0.1, 0.2, 0.2, 1.0, 1.0])
FEATURE_WEIGHTS = np.array([1.0, 0.5, 0.5, 1.0, 1.0])
CIRCULAR = np.array([True, False, False, False, False])
GRAPH_SPREAD = 1000.0  # metres between graphs along the 4th coordinate of the joint KD-tree
CANDIDATES = MAX_NNEIGHBORS + 2  # nodes ranked by the matmul key, re-ranked exactly
# (cells x hypotheses x nmax) float64 keys per chunk of the torch search, per device type: 256 MiB
# on the CPU, 2 GiB on a GPU (the whole 770k-hypothesis update in 2 chunks: fewer launches)
KNN_CHUNK_ELEMENTS = {"cpu": 1 << 25, "cuda": 1 << 28}
# How the torch search picks its CANDIDATES per hypothesis, per device type (``select=``):
# "topk": torch.topk; "rounds": CANDIDATES min-reductions, each a bandwidth-bound pass over the
# keys. On the H200, topk's radix selection (gatherTopK) on 770k rows of 400 keys was 55% of the
# update's GPU time (8.3 ms per chunk); five passes over a chunk's 0.6 GB of float32 keys move
# about 3 GB, under 1 ms at that GPU's bandwidth. On the CPU topk is faster (1.2-1.6x here).
# Not yet measured on a GPU: `--only cuda --device cuda` times both (docs/gpu.md).
SELECT = {"cpu": "topk", "cuda": "rounds"}


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Minimum wall time over ``repeat`` runs (after one warm-up) and the last output."""
    out = fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


# ---------------------------------------------------------------- workload (a): Monty hypotheses


@dataclass(frozen=True)
class Graph:
    """One learned object graph: node locations, pose vectors (surface normal, two curvature
    directions, (n, 9)), whether the curvature directions are defined, non-pose features."""

    nodes: np.ndarray
    pose_vectors: np.ndarray
    pose_defined: np.ndarray
    features: np.ndarray


@dataclass(frozen=True)
class MontyData:
    graphs: list[Graph]  # per (module, object)
    loc: list[np.ndarray]  # per (module, object): (H, 3) hypothesis locations
    rot: list[np.ndarray]  # per (module, object): (H, 3, 3) hypothesis rotations
    evidence: list[np.ndarray]  # per (module, object): (H,)
    disp: np.ndarray  # (L, 3) sensor displacement per module
    obs_pose: np.ndarray  # (L, 3, 3) sensed pose vectors per module (rows: normal, cd1, cd2)
    obs_feat: np.ndarray  # (L, F) sensed non-pose features per module
    modules: int
    objects: int


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.linalg.norm(v, axis=-1, keepdims=True)


def make_monty(
    modules: int, objects: int, hyps: int, nodes: tuple[int, int], seed: int = 0
) -> MontyData:
    """Object graphs on ~10 cm surfaces; hypotheses start near nodes (as Monty initialises them)."""
    rng = np.random.default_rng(seed)
    graphs, loc, rot, ev = [], [], [], []
    for _ in range(modules * objects):
        n = int(rng.integers(*nodes))
        normal = _unit(rng.normal(size=(n, 3)))
        pts = normal * 0.05 * rng.uniform(0.9, 1.1, size=(n, 1))
        cd1 = _unit(np.cross(normal, rng.normal(size=(n, 3))))
        pose = np.concatenate([normal, cd1, np.cross(normal, cd1)], axis=1)
        feats = np.concatenate([rng.uniform(size=(n, 3)), rng.normal(size=(n, 2))], axis=1)
        graphs.append(Graph(pts, pose, rng.uniform(size=n) < 0.7, feats))
        on = rng.integers(0, n, size=hyps)
        loc.append(pts[on] + rng.normal(scale=0.003, size=(hyps, 3)))
        q, _ = np.linalg.qr(rng.normal(size=(hyps, 3, 3)))
        rot.append(np.ascontiguousarray(q))
        ev.append(rng.normal(size=hyps))
    normal = _unit(rng.normal(size=(modules, 3)))
    cd1 = _unit(np.cross(normal, rng.normal(size=(modules, 3))))
    obs_pose = np.stack([normal, cd1, np.cross(normal, cd1)], axis=1)
    obs_feat = np.concatenate(
        [rng.uniform(size=(modules, 3)), rng.normal(size=(modules, 2))], axis=1
    )
    disp = rng.normal(scale=0.005, size=(modules, 3))
    return MontyData(graphs, loc, rot, ev, disp, obs_pose, obs_feat, modules, objects)


def node_feature_evidence(feats: np.ndarray, query: np.ndarray) -> np.ndarray:
    """Monty's default feature evidence of every node: tolerance-scaled match in [0, 1], averaged
    with the feature weights; hue differences wrap around."""
    diff = np.zeros_like(feats)
    diff[:, ~CIRCULAR] = np.abs(feats[:, ~CIRCULAR] - query[~CIRCULAR])
    f, q = feats[:, CIRCULAR], query[CIRCULAR]
    diff[:, CIRCULAR] = np.min([np.abs(1 + f - q), np.abs(f - q), np.abs(f - (q + 1))], axis=0)
    match = np.clip(TOLERANCES - diff, 0, np.inf) / TOLERANCES
    return np.average(match, weights=FEATURE_WEIGHTS, axis=1)


def monty_baseline(
    data: MontyData, trees: list[cKDTree], pool: ThreadPoolExecutor
) -> list[tuple[np.ndarray, ...]]:
    """Monty today: for each learning module, one thread per object graph, each running the
    evidence update of Monty's default hypotheses displacer in numpy with the graph's KD-tree."""

    def update(mod: int, g: int) -> tuple[np.ndarray, ...]:
        graph, rot = data.graphs[g], data.rot[g]
        search = data.loc[g] + rot.dot(data.disp[mod])
        # Sensed pose vectors in each hypothesis's frame: (H, 3 vectors, 3).
        pose = np.dot(rot, data.obs_pose[mod].T).transpose(0, 2, 1)
        _, nearest = trees[g].query(search, k=MAX_NNEIGHBORS, p=2, workers=1)
        # Distance stretched along the hypothesis's surface normal, less so on curved surfaces.
        offset = graph.nodes[nearest] - search[:, None, :]
        along = np.einsum("ijk,ik->ij", offset, pose[:, 0])
        curvature = np.max(np.abs(data.obs_feat[mod, 3:]))
        dist = np.linalg.norm(offset, axis=2) + np.abs(along) * (1 / (curvature + 0.5))
        too_far = (MAX_MATCH_DISTANCE - dist) / MAX_MATCH_DISTANCE <= 0
        node_pose = graph.pose_vectors[nearest]  # (H, K, 9)
        normal_angle = np.arccos(
            np.clip(np.einsum("ijk,ik->ij", node_pose[:, :, :3], pose[:, 0]), -1, 1)
        )
        normal_ev = -(np.sin(normal_angle / 2) - 0.5)
        cd_angle = np.arccos(
            np.clip(np.einsum("ijk,ik->ij", node_pose[:, :, 3:6], pose[:, 1]), -1, 1)
        )
        cd_ev = -(np.sin(np.pi / 2 - np.abs(cd_angle - np.pi / 2)) - 0.5)
        cd_ev = cd_ev * graph.pose_defined[nearest]
        radius_ev = normal_ev * POSE_WEIGHTS[0] + cd_ev * POSE_WEIGHTS[1]
        radius_ev[too_far] = -1
        feature_ev = node_feature_evidence(graph.features, data.obs_feat[mod])[nearest]
        feature_ev[too_far] = 0
        radius_ev = radius_ev + feature_ev * FEATURE_EVIDENCE_INCREMENT
        new_ev = np.max(radius_ev, axis=1)
        ev = data.evidence[g] * PAST_WEIGHT + new_ev * PRESENT_WEIGHT
        return ev, nearest, search

    out = []
    for mod in range(data.modules):
        futures = [pool.submit(update, mod, mod * data.objects + o) for o in range(data.objects)]
        out.extend(f.result() for f in futures)
    return out


class MontyUpdate:
    """The bound model: Monty's evidence update for every (module, object) cell in one call.

    It holds the learned graphs on ``device`` (as a model holds its weights), padded to the largest
    graph: (graphs, nmax, ...) with a padded row ``graph * nmax + node`` per node. Two nearest-node
    searches give the same K nodes (:meth:`nearest`):

    - ``knn="torch"`` (any device, the GPU path): a brute-force search in torch, in chunks of
      cells; no host round trip, no numpy.
    - ``knn="tree"`` (CPU only): one scipy KD-tree over all graphs, the graph index as a 4th
      coordinate ``GRAPH_SPREAD`` apart, so a query only ever meets nodes of its own graph and
      squared distances are those of the graph's own tree (``+ 0.0``). One ``query`` (C, GIL
      released, ``workers`` threads) serves every hypothesis.

    The rest is a few batched torch ops over all hypotheses.
    """

    def __init__(
        self,
        graphs: list[Graph],
        *,
        device: str | torch.device = "cpu",
        knn: str = "torch",
        workers: int = 1,
        compile: bool = False,
        chunk: int | None = None,
        select: str | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.chunk = chunk or KNN_CHUNK_ELEMENTS.get(self.device.type, 1 << 25)
        self.select = select or SELECT.get(self.device.type, "topk")
        if self.select not in ("topk", "rounds"):
            raise ValueError(f"select={self.select!r}: 'topk' or 'rounds'")
        if knn not in ("torch", "tree") or (knn == "tree" and self.device.type != "cpu"):
            raise ValueError(f"knn={knn!r} on {self.device}: 'tree' runs on the cpu, else 'torch'")
        self.knn, self.workers = knn, workers
        sizes = [g.nodes.shape[0] for g in graphs]
        self.nmax = max(sizes)

        def padded(field: str) -> Tensor:
            """(G, nmax, ...) float64 on the device, zeros past each graph's size."""
            rows = [getattr(g, field).astype(np.float64) for g in graphs]
            out = torch.zeros((len(graphs), self.nmax, *rows[0].shape[1:]), dtype=torch.float64)
            for i, r in enumerate(rows):
                out[i, : sizes[i]] = torch.from_numpy(r)
            return out.to(self.device)

        self.nodes = padded("nodes")  # (G, nmax, 3), zeros past each graph's size
        self.pose = padded("pose_vectors").flatten(0, 1)  # (G * nmax, 9)
        self.defined = padded("pose_defined").flatten(0, 1)  # (G * nmax,) 1.0 / 0.0
        self.features = padded("features")  # (G, nmax, F)
        self.sizes = torch.tensor(sizes, device=self.device)  # (G,)
        real = torch.arange(self.nmax, device=self.device) < self.sizes[:, None]
        # |node|^2, +inf on padding: the ranking key of the torch search never picks a pad first.
        self.node_sq = torch.where(real, self.nodes.square().sum(-1), torch.inf)  # (G, nmax)
        # The ranking key in float32 (the GPU's top-k selects on 32-bit keys in half the radix
        # passes of 64-bit ones, and the matmul is an sgemm): it only picks CANDIDATES, which
        # are then re-ranked with exact float64 distances; check_monty compares every neighbour
        # with the KD-tree's. Key error ~1e-10 (|node|^2 ~ 2.5e-3 m^2) against gaps of ~1e-6.
        # Pads rank last with the largest finite float32, not +inf: a selection by rounds marks
        # what it picked +inf, so a row short of real nodes picks distinct pads, never a node twice.
        self.nodes32 = self.nodes.float()
        self.node_sq32 = self.node_sq.clamp_max(torch.finfo(torch.float32).max).float()
        self.tol = torch.from_numpy(TOLERANCES).to(self.device)
        self.weights = torch.from_numpy(FEATURE_WEIGHTS).to(self.device)
        self.circular = torch.from_numpy(CIRCULAR).to(self.device)
        if knn == "tree":
            offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
            self.tree_offsets = torch.from_numpy(offsets)  # (G,) first joint-tree row per graph
            graph_coord = np.repeat(np.arange(len(graphs)) * GRAPH_SPREAD, sizes)[:, None]
            joint = np.concatenate([g.nodes for g in graphs])
            self.tree = cKDTree(np.concatenate([joint, graph_coord], axis=1))
        # compile=True fuses the elementwise chain into a few loops (torch.compile, inductor).
        self.evidence = (
            torch.compile(hypothesis_evidence, dynamic=False) if compile else hypothesis_evidence
        )

    def nearest(self, graph: Tensor, search: Tensor) -> Tensor:
        """(B,), (B, H, 3) -> (B, H, K) int64: each hypothesis's K nearest nodes of its cell's
        graph (node index within the graph), nearest first, equal distances by node index."""
        if self.knn == "tree":
            return self._nearest_tree(graph, search)
        b, h = search.shape[:2]
        step = max(1, self.chunk // (h * self.nmax))  # cells per chunk
        parts = [
            self._nearest_chunk(graph[lo : lo + step], search[lo : lo + step])
            for lo in range(0, b, step)
        ]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _nearest_chunk(self, graph: Tensor, search: Tensor) -> Tensor:
        nodes = self.nodes[graph]  # (c, nmax, 3)
        # |n|^2 - 2 s.n ranks the nodes as |s - n|^2 does (|s|^2 is the same along a row): one
        # batched float32 matmul, then the CANDIDATES best, re-ranked below with exact float64
        # distances.
        key = torch.baddbmm(
            self.node_sq32[graph][:, None, :], search.float(), self.nodes32[graph].mT, alpha=-2.0
        )
        if self.select == "topk":
            cand = key.topk(CANDIDATES, dim=-1, largest=False, sorted=False).indices  # (c, H, C)
        else:
            cand = smallest_by_rounds(key, CANDIDATES)
        cand = cand.sort(-1).values  # by node index: the stable sort below breaks ties by index
        rows = torch.arange(graph.shape[0], device=self.device)[:, None, None] * self.nmax + cand
        d = nodes.flatten(0, 1)[rows] - search[:, :, None, :]  # (c, H, C, 3)
        # Summed x, y, z in this order, as scipy's KD-tree does: the same float64 distances.
        d2 = d[..., 0] * d[..., 0] + d[..., 1] * d[..., 1] + d[..., 2] * d[..., 2]
        d2 = torch.where(cand < self.sizes[graph][:, None, None], d2, torch.inf)
        order = d2.sort(dim=-1, stable=True).indices[..., :MAX_NNEIGHBORS]
        return cand.gather(-1, order)

    def _nearest_tree(self, graph: Tensor, search: Tensor) -> Tensor:
        b, h = search.shape[:2]
        where = (graph.double() * GRAPH_SPREAD)[:, None, None].expand(b, h, 1)
        queries = torch.cat([search, where], -1).reshape(-1, 4).numpy()
        _, flat = self.tree.query(queries, k=MAX_NNEIGHBORS, p=2, workers=self.workers)
        rows = torch.from_numpy(flat).view(b, h, MAX_NNEIGHBORS)  # rows of the joint tree
        return rows - self.tree_offsets[graph][:, None, None]

    def node_feature_evidence(self, graph: Tensor, query: Tensor) -> Tensor:
        """(B,), (B, F) -> (B, nmax): Monty's feature evidence of every node of each cell's graph
        (:func:`node_feature_evidence` in torch; hue differences wrap around)."""
        feats, q = self.features[graph], query[:, None, :]  # (B, nmax, F), (B, 1, F)
        diff = (feats - q).abs()
        wrap = torch.minimum(torch.minimum((1 + feats - q).abs(), diff), (feats - (q + 1)).abs())
        diff = torch.where(self.circular, wrap, diff)
        match = (self.tol - diff).clamp_min(0) / self.tol
        return (match * self.weights).sum(-1) / self.weights.sum()

    def __call__(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        rot, graph = inputs["rot"], inputs["graph"]  # (B, H, 3, 3), (B,)
        search = inputs["loc"] + (rot @ inputs["disp"][:, None, :, None])[..., 0]  # (B, H, 3)
        local = self.nearest(graph, search)  # (B, H, K)
        rows = graph[:, None, None] * self.nmax + local  # padded rows of the nodes
        cell_rows = torch.arange(graph.shape[0], device=self.device)[:, None, None] * self.nmax
        node_ev = self.node_feature_evidence(graph, inputs["obs_feat"]).flatten()
        ev = self.evidence(
            rot,
            inputs["obs_pose"],
            inputs["obs_feat"],
            inputs["evidence"],
            search,
            self.nodes.flatten(0, 1)[rows],
            node_ev[cell_rows + local],
            self.pose[rows],
            self.defined[rows],
        )
        # proposal (B, H): new evidence; score (B,): the best hypothesis of each object graph.
        return {"proposal": ev, "score": ev.amax(-1), "nearest": local, "location": search}


def smallest_by_rounds(key: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` smallest keys along the last dimension (any order; ties: the lower
    index first), by ``k`` min-reductions, each followed by setting the key it picked to +inf
    (``key`` is overwritten). Each row needs at least ``k`` keys below +inf, else a key it
    already picked is picked again."""
    out = torch.empty((*key.shape[:-1], k), dtype=torch.long, device=key.device)
    for r in range(k):
        at = key.argmin(-1, keepdim=True)
        out[..., r : r + 1] = at
        key.scatter_(-1, at, torch.inf)
    return out


def hypothesis_evidence(
    rot: Tensor,
    obs_pose: Tensor,
    obs_feat: Tensor,
    evidence: Tensor,
    search: Tensor,
    near: Tensor,
    feature_ev: Tensor,
    near_pose: Tensor,
    defined: Tensor,
) -> Tensor:
    """The elementwise part of the update for (B, H) hypotheses and their K nearest nodes:
    ``near`` (B, H, K, 3) their locations, ``near_pose`` (B, H, K, 9), ``defined`` and
    ``feature_ev`` (B, H, K)."""
    pose = (rot @ obs_pose.transpose(1, 2)[:, None]).transpose(-1, -2)  # (B, H, 3 vectors, 3)
    offset = near - search[:, :, None, :]
    normal = pose[:, :, 0]
    along = (offset * normal[:, :, None, :]).sum(-1)
    curvature = obs_feat[:, 3:].abs().amax(-1)[:, None, None]
    dist = offset.norm(dim=-1) + along.abs() * (1 / (curvature + 0.5))
    too_far = (MAX_MATCH_DISTANCE - dist) / MAX_MATCH_DISTANCE <= 0
    cos_n = (near_pose[..., 0:3] * normal[:, :, None, :]).sum(-1)
    normal_ev = -(torch.sin(torch.arccos(cos_n.clamp(-1, 1)) / 2) - 0.5)
    cos_cd = (near_pose[..., 3:6] * pose[:, :, None, 1]).sum(-1)
    cd_angle = torch.arccos(cos_cd.clamp(-1, 1))
    cd_ev = -(torch.sin(torch.pi / 2 - (cd_angle - torch.pi / 2).abs()) - 0.5)
    cd_ev = cd_ev * defined
    radius_ev = normal_ev * POSE_WEIGHTS[0] + cd_ev * POSE_WEIGHTS[1]
    radius_ev = torch.where(too_far, -1.0, radius_ev + feature_ev * FEATURE_EVIDENCE_INCREMENT)
    return evidence * PAST_WEIGHT + radius_ev.amax(-1) * PRESENT_WEIGHT


def monty_cells(data: MontyData) -> dict[str, Tensor]:
    """One row per (module, object) cell: its graph and its module's observation."""

    def per_module(a: np.ndarray) -> Tensor:
        return torch.from_numpy(a).repeat_interleave(data.objects, 0)

    return {
        "graph": torch.arange(data.modules * data.objects),
        "disp": per_module(data.disp),
        "obs_pose": per_module(data.obs_pose),
        "obs_feat": per_module(data.obs_feat),
    }


def monty_lmpm(data: MontyData, model: MontyUpdate, backend: Backend) -> list[tuple[Tensor, ...]]:
    """LMPM: every module and object dispatches its work item; one collect; one model call."""
    cells = monty_cells(data)
    items = []
    for g in range(data.modules * data.objects):
        inputs = {name: t[g : g + 1] for name, t in cells.items()}
        for name, per in (("loc", data.loc), ("rot", data.rot), ("evidence", data.evidence)):
            inputs[name] = torch.from_numpy(per[g])[None]
        items.append(WorkItem("update_evidence", model, inputs, torch.tensor([g])))
    res = backend.collect(backend.dispatch(items))
    # Each item is one cell: drop the cell dim to get (H,), (H, K), (H, 3) per (module, object).
    parts = zip(res.split("proposal"), res.split("nearest"), res.split("location"))
    return [(ev[0], idx[0], loc[0]) for ev, idx, loc in parts]


def monty_item(data: MontyData, model: MontyUpdate) -> WorkItem:
    """One work item over all (module, object) cells: the hypotheses are resident (``put_monty``),
    only the observations cross."""
    return WorkItem(
        "update_evidence",
        model,
        {**{name: Ref(name) for name in ("loc", "rot", "evidence")}, **monty_cells(data)},
        torch.arange(data.modules * data.objects),
    )


def put_monty(data: MontyData, backend: Backend) -> None:
    """The hypotheses become resident on the backend's device, one row per (module, object)."""
    for name, per in (("loc", data.loc), ("rot", data.rot), ("evidence", data.evidence)):
        backend.put(name, torch.from_numpy(np.stack(per)))


def monty_resident(
    data: MontyData, model: MontyUpdate, backend: Backend
) -> list[tuple[Tensor, ...]]:
    """LMPM: one dispatch and one collect of :func:`monty_item`."""
    group = backend.collect(backend.dispatch(monty_item(data, model))).groups[0]
    return list(zip(group.proposal, group.aux["nearest"], group.aux["location"]))


def monty_size(scale: float) -> tuple[int, int, int]:
    """(modules, objects, hypotheses) at ``scale`` (1.0: 5 x 77 x 2000, 770k hypotheses)."""
    return 5, max(1, round(77 * scale)), max(10, round(2000 * scale))


def bench_monty(args: argparse.Namespace, backend: Backend) -> dict[str, Any]:
    modules, objects, hyps = monty_size(args.scale)
    data = make_monty(modules, objects, hyps, nodes=(200, 400))
    t0 = time.perf_counter()
    trees = [cKDTree(g.nodes) for g in data.graphs]  # Monty builds these when it learns a graph
    tree_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    model = MontyUpdate(data.graphs, knn="tree", workers=args.threads)  # one joint tree
    model_build = time.perf_counter() - t0
    put_monty(data, backend)
    with ThreadPoolExecutor() as pool:
        base_s, base = best_of(lambda: monty_baseline(data, trees, pool), args.repeat)
        pool_threads = pool._max_workers
    lmpm_s, ours = best_of(lambda: monty_resident(data, model, backend), args.repeat)
    items_s, ours_items = best_of(lambda: monty_lmpm(data, model, backend), args.repeat)
    outs = [ours, ours_items]
    extra: dict[str, Any] = {}
    if args.compile:
        compiled = MontyUpdate(data.graphs, knn="tree", workers=args.threads, compile=True)
        t0 = time.perf_counter()
        monty_resident(data, compiled, backend)  # compiles
        extra["lmpm_compiled_first_s"] = round(time.perf_counter() - t0, 3)
        comp_s, ours_comp = best_of(lambda: monty_resident(data, compiled, backend), args.repeat)
        extra["lmpm_compiled_s"] = round(comp_s, 5)
        extra["ratio_compiled"] = round(base_s / comp_s, 2)
        outs.append(ours_comp)
    for out in outs:
        check_monty(base, out)
    return {
        "benchmark": "backends",
        "workload": "monty",
        "baseline_s": round(base_s, 5),
        "lmpm_s": round(lmpm_s, 5),
        "ratio": round(base_s / lmpm_s, 2),
        "goal": 5.0,
        "lmpm_items_s": round(items_s, 5),
        "ratio_items": round(base_s / items_s, 2),
        **extra,
        "params": {
            **_monty_params(modules, objects, hyps, pool_threads),
            "kdtree_build_s": round(tree_build, 5),
            "lmpm_model_build_s": round(model_build, 5),
            "lmpm_s": "one work item over resident tensors",
            "lmpm_items_s": "one work item per (module, object), fused by batch_items",
        },
    }


def _monty_params(modules: int, objects: int, hyps: int, pool_threads: int) -> dict[str, Any]:
    """The size and the comparison shared by the Monty workloads' JSON lines."""
    return {
        "modules": modules,
        "objects": objects,
        "hypotheses": hyps,
        "nodes": [200, 400],
        "k": MAX_NNEIGHBORS,
        "threads": torch.get_num_threads(),
        "baseline_pool_threads": pool_threads,
        "outputs": "nearest nodes and locations equal, evidence allclose(rtol=atol=1e-9)",
    }


def check_monty(base: list[tuple[np.ndarray, ...]], ours: list[tuple[Tensor, ...]]) -> None:
    for g, (b, o) in enumerate(zip(base, ours, strict=True)):
        ev, idx, loc = (t.cpu().numpy() for t in o)
        if not np.array_equal(np.sort(b[1], axis=1), np.sort(idx, axis=1)):
            raise SystemExit(f"monty: nearest nodes differ for graph {g}")
        if not np.allclose(b[2], loc, rtol=1e-12, atol=1e-15):
            raise SystemExit(f"monty: locations differ for graph {g}")
        if not np.allclose(b[0], ev, rtol=1e-9, atol=1e-9):
            raise SystemExit(f"monty: evidence differs for graph {g}")


# ---------------------------------------------------------------- workload (b): small model


def make_mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 32),
        torch.nn.ReLU(),
        torch.nn.Linear(32, 8),
    ).eval()


def bench_small_model(args: argparse.Namespace, backend: Backend) -> dict[str, Any]:
    objects, rows = max(1, round(2000 * args.scale)), 4
    mlp = make_mlp()
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(rows, 16, generator=gen) for _ in range(objects)]
    cells = [torch.arange(i * rows, (i + 1) * rows) for i in range(objects)]

    def baseline() -> list[Tensor]:
        with torch.no_grad():
            return [mlp(x) for x in xs]

    def model(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        y = mlp(inputs["x"])  # (N, 8): one payload vector per cell
        return {"proposal": y, "score": torch.zeros(y.shape[0])}

    def lmpm_items() -> list[Tensor]:
        items = [WorkItem("mlp", model, {"x": x}, c) for x, c in zip(xs, cells)]
        return backend.collect(backend.dispatch(items)).split("proposal")

    backend.put("x", torch.cat(xs))  # LMPM layout: the objects' inputs are one resident value
    all_cells = torch.cat(cells)

    def lmpm() -> list[Tensor]:
        item = WorkItem("mlp", model, {"x": Ref("x")}, all_cells)
        return list(backend.collect(backend.dispatch(item)).groups[0].proposal.split(rows))

    base_s, base = best_of(baseline, args.repeat)
    lmpm_s, ours = best_of(lmpm, args.repeat)
    items_s, ours_items = best_of(lmpm_items, args.repeat)
    for out in (ours, ours_items):
        if not all(
            torch.allclose(b, o.cpu(), rtol=1e-5, atol=1e-6) for b, o in zip(base, out, strict=True)
        ):
            raise SystemExit("small_model: outputs differ")
    return {
        "benchmark": "backends",
        "workload": "small_model",
        "baseline_s": round(base_s, 5),
        "lmpm_s": round(lmpm_s, 5),
        "ratio": round(base_s / lmpm_s, 2),
        "goal": 20.0,
        "lmpm_items_s": round(items_s, 5),
        "ratio_items": round(base_s / items_s, 2),
        "params": {
            "objects": objects,
            "rows_per_object": rows,
            "mlp": "16-32-32-8",
            "threads": torch.get_num_threads(),
        },
    }


# ---------------------------------------------------------------- (c): the GPU path


def device_backends(device: str) -> tuple[Backend, Backend]:
    """(results stay on the device, results copied to the host) backends of ``device``; on the
    cpu both are one cpu backend, whose results are on the host already."""
    if device == "cpu":
        cpu = get_backend("cpu")
        return cpu, cpu
    return get_backend(device, results_to_host=False), get_backend(device)


def device_name(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"cpu ({platform.machine()}, {os.cpu_count()} cores)"


def time_dispatch(backend: Backend, item: WorkItem) -> dict[str, Any]:
    """One dispatch then collect: the time dispatch holds the caller against the whole update,
    whether the work still ran when dispatch returned, and (CUDA) how many host-device
    synchronisations dispatch made (``torch.cuda.set_sync_debug_mode`` warns on each)."""
    cuda = backend.device.type == "cuda"
    backend.collect(backend.dispatch(item))  # warm-up: allocator, cuBLAS handles
    if cuda:
        torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        t0 = time.perf_counter()
        handle = backend.dispatch(item)
        t_dispatch = time.perf_counter() - t0
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
    ready = backend.ready(handle)
    backend.collect(handle)
    t_total = time.perf_counter() - t0
    # PyTorch's detector warns "called a synchronizing CUDA operation" per sync; turning it on
    # warns once that it is a prototype (which an earlier version of this count took for a sync)
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    return {
        "dispatch_s": round(t_dispatch, 6),
        "dispatch_to_collect_s": round(t_total, 6),
        "dispatch_share": round(t_dispatch / t_total, 3),
        "ready_right_after_dispatch": ready,
        # The cpu backend computes inside dispatch by design: False there, expected True on CUDA.
        "dispatch_returns_first": not ready,
        "syncs_in_dispatch": len(syncs) if cuda else None,
        # where each one happened (the Python line that called the synchronizing op)
        "sync_sites": sorted({f"{w.filename}:{w.lineno}" for w in syncs}) if cuda else None,
    }


def bench_cuda(args: argparse.Namespace) -> dict[str, Any]:
    """The Monty update on ``args.device`` (the GPU path: the torch nearest-node search, every
    tensor on the device) against Monty's per-object loop on this machine's CPU."""
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        return {"benchmark": "backends", "workload": "cuda", "skipped": "no CUDA device"}
    resident, to_host = device_backends(device)
    modules, objects, hyps = monty_size(args.scale)
    data = make_monty(modules, objects, hyps, nodes=(200, 400))
    trees = [cKDTree(g.nodes) for g in data.graphs]
    model = MontyUpdate(data.graphs, device=resident.device, knn="torch")
    for backend in {id(b): b for b in (resident, to_host)}.values():
        put_monty(data, backend)
    with ThreadPoolExecutor() as pool:
        base_s, base = best_of(lambda: monty_baseline(data, trees, pool), args.repeat)
        pool_threads = pool._max_workers
    lmpm_s, ours = best_of(lambda: monty_resident(data, model, resident), args.repeat)
    host_s, ours_host = best_of(lambda: monty_resident(data, model, to_host), args.repeat)
    # the other candidate selection, timed the same way (which one a device should use)
    other = "topk" if model.select == "rounds" else "rounds"
    alt = MontyUpdate(data.graphs, device=resident.device, knn="torch", select=other)
    alt_s, ours_alt = best_of(lambda: monty_resident(data, alt, resident), args.repeat)
    for out in (ours, ours_host, ours_alt):
        check_monty(base, out)
    return {
        "benchmark": "backends",
        "workload": "cuda",
        "device": device_name(device),
        "backend": resident.name,
        "dry_run": device != "cuda",
        "baseline_s": round(base_s, 5),
        "lmpm_s": round(lmpm_s, 5),
        "ratio": round(base_s / lmpm_s, 2),
        "goal": 20.0,
        "lmpm_to_host_s": round(host_s, 5),
        "ratio_to_host": round(base_s / host_s, 2),
        "select": model.select,
        f"lmpm_{other}_s": round(alt_s, 5),
        f"ratio_{other}": round(base_s / alt_s, 2),
        **time_dispatch(resident, monty_item(data, model)),
        "params": {
            **_monty_params(modules, objects, hyps, pool_threads),
            "knn": f"torch: float32 matmul key, {CANDIDATES} candidates re-ranked exactly "
            f"(float64), chunks of {model.chunk} keys",
            "select": "how the candidates are picked: topk (torch.topk) or rounds (one "
            "min-reduction per candidate); lmpm_s uses the device's default (SELECT)",
            "baseline": "Monty's per-object loop on this machine's CPU (numpy + cKDTree)",
            "lmpm_s": "one work item over resident tensors, results left on the device",
            "lmpm_to_host_s": "the same, results copied to host memory",
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=1.0, help="scales objects and hypotheses")
    parser.add_argument(
        "--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch intra-op threads"
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="timed runs per side (best is reported)"
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the Monty model with its elementwise part under torch.compile",
    )
    parser.add_argument("--only", choices=["monty", "small_model", "cuda"], default=None)
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where the cuda workload runs LMPM (cpu: the same GPU code path, a dry run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run for the benchmark summary (python -m benchmarks)",
    )
    args = parser.parse_args()
    if args.quick:
        # a quarter of the work, timed best of three like a full run (one timed run of a
        # sub-millisecond call measures the machine's noise more than the call)
        args.scale, args.repeat = 0.25, 3
    torch.set_num_threads(args.threads)
    cpu = get_backend("cpu")
    if args.only in (None, "monty"):
        print(json.dumps(bench_monty(args, cpu)), flush=True)
    if args.only in (None, "small_model"):
        print(json.dumps(bench_small_model(args, cpu)), flush=True)
    if args.only in (None, "cuda"):
        print(json.dumps(bench_cuda(args)), flush=True)


if __name__ == "__main__":
    main()
