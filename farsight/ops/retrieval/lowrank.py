"""Exact top-k retrieval with a low-rank screen: long memories where bf16 GEMMs are slow.

Trained landmark keys lie close to a low-dimensional subspace: the shipped demo DRT's keys over a
128K-token prefix of Python source keep 99.99% of their energy in 16 of 128 dimensions. With P
[r, D] an orthonormal basis of that subspace (the top right singular vectors of the keys), write
k = k_r P + k_perp with k_r = k P^T, and q likewise. Then

    q . k = q_r . k_r + q_perp . k_perp,    |q_perp . k_perp| <= |q_perp| |k_perp|

(Cauchy-Schwarz), so the screen scores q_r . k_r, a GEMM over r dimensions instead of D in the
score dtype, and every key of a group g is off by at most |q_perp| rho_g, rho_g the largest
|k_perp| in the group, plus a margin for rounding (`_topk_one_row`). farsight.ops.retrieval.groups
turns that bound into the exact top-k. The basis decides only how many keys are rescored, never
which chunks are retrieved: the top-k is exact for any basis, and keys that are not close to a
low-rank subspace (random ones, an untrained model) are scored in full.

`LowRankKeys` keeps a growing memory's basis, the keys' coordinates in it [B, n, r] (r/D of the
keys' size) and their residual norms; the basis is fitted once the memory holds `min_keys`
keys and refitted (every key projected again) whenever the memory has doubled since, up to
REFIT_LIMIT keys, and beyond only if new keys drift out of it, so the work per key stays O(r D)
however long the memory grows and a long memory never pauses to refit without need.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from farsight.errors import InputError
from farsight.ops.buffers import GrowingBuffer
from farsight.ops.retrieval.groups import group_maxima, topk_from_groups
from farsight.ops.retrieval.reference import retrieval_topk_reference, score_dtype

# Keys per group (farsight.ops.retrieval.groups): with the cheap r-dim screen, fewer larger groups
# beat 16-key ones (36 vs 53 ms for 512K demo-like keys on a 2-core AVX2 EPYC; 48 was no better).
GROUP = 32
RESIDUAL_ENERGY = 1e-4  # the basis keeps all but this fraction of the keys' squared norms
RANK_STEP = 8  # ranks are multiples of this
MAX_RANK_FRACTION = 4  # a basis of more than D / 4 dimensions saves too little of a full scan
FIT_SAMPLE = 4096  # keys (evenly spaced) that a basis is fitted to
REFIT_LIMIT = 65536  # refits at each doubling of the memory stop here (LowRankKeys._refit_due)
DRIFT, DRIFT_MIN_KEYS = 10, 1024  # beyond: refit once 1024+ new keys keep 10x RESIDUAL_ENERGY outside the basis


def fit_basis(keys: torch.Tensor) -> torch.Tensor | None:
    """keys [B, n, D] (n >= 1) -> an orthonormal basis [B, r, D] that keeps all but
    RESIDUAL_ENERGY of every row's energy (r a multiple of RANK_STEP, shared by the rows), or
    None when that takes more than D / MAX_RANK_FRACTION dimensions."""
    n, d = keys.shape[1], keys.shape[2]
    sample = keys[:, torch.linspace(0, n - 1, min(n, FIT_SAMPLE), device=keys.device).long()]
    _, singular, vh = torch.linalg.svd(sample, full_matrices=False)  # vh [B, min(s, D), D]
    energy = singular.square().cumsum(dim=1)
    left = 1 - energy / energy[:, -1:].clamp(min=torch.finfo(energy.dtype).tiny)  # [B, min(s, D)]
    needed = int((left > RESIDUAL_ENERGY).sum(dim=1).max()) + 1  # dimensions every row needs
    rank = -(-needed // RANK_STEP) * RANK_STEP
    if rank > d // MAX_RANK_FRACTION or rank > vh.shape[1]:
        return None
    return vh[:, :rank].contiguous()


class LowRankKeys:
    """The low-rank screen's view of a growing memory of keys [B, n, D] (module docstring).

    `update(keys)` is called with all the memory's keys after each append, `truncate(n)` when the
    memory drops its last keys. `basis` is None until a fit has found a low-rank subspace.
    """

    def __init__(self, min_keys: int = 1) -> None:
        self.min_keys = min_keys
        self.basis: torch.Tensor | None = None  # [B, r, D] in the keys' score dtype
        # [B, n, r] k_r of every key (only while basis is set) and [B, n] |k_perp|; rows are never
        # rewritten, so the buffers spread their doublings (farsight.ops.buffers)
        self.coords = GrowingBuffer(dim=1, spread_growth=True)
        self.residuals = GrowingBuffer(dim=1, spread_growth=True)
        self.max_norm: torch.Tensor | None = None  # >= every key's norm (stays a bound after truncate)
        self.n_keys = 0  # keys seen (those of the memory)
        self.fitted_at = 0  # keys in the memory at the last fit (0: none yet)
        self._since_fit: tuple[int, torch.Tensor | float, torch.Tensor | float] = (
            0,
            0.0,
            0.0,
        )  # keys, energy, residual energy

    def update(self, keys: torch.Tensor) -> None:
        """Catch up with `keys` [B, n, D], the memory's keys after an append (the first n_keys
        rows are the ones seen before). Only the new rows are cast to the score dtype, and all of
        them only at a refit: casting every bf16 key on every append made a 16M-token prefill
        quadratic (a third of its time)."""
        dtype = score_dtype(keys.dtype)
        keys = keys.detach()
        new = keys[:, self.n_keys :].to(dtype)
        self.n_keys = keys.shape[1]
        if new.shape[1]:
            norm = new.norm(dim=-1).max()
            self.max_norm = norm if self.max_norm is None else torch.maximum(self.max_norm, norm)
        if self.max_norm is not None and not bool(torch.isfinite(self.max_norm)):
            self.basis = None  # a non-finite key: every retrieval of this memory scores all keys
            return
        if self.basis is not None and new.shape[1]:
            self._project(new)
        if self._refit_due():
            self.fitted_at = self.n_keys
            keys = keys.to(dtype)
            self.basis = fit_basis(keys)
            self.coords.clear()
            self.residuals.clear()
            if self.basis is not None:
                self._project(keys)
            self._since_fit = (0, 0.0, 0.0)

    def _project(self, new: torch.Tensor) -> None:
        """Append the coordinates and residual norms of keys `new` [B, m, D]."""
        coords = new @ self.basis.transpose(1, 2)  # [B, m, r]
        residuals = (new - coords @ self.basis).norm(dim=-1)  # [B, m]
        self.coords.append(coords)
        self.residuals.append(residuals)
        count, energy, residual = self._since_fit
        self._since_fit = (count + new.shape[1], energy + new.square().sum(), residual + residuals.square().sum())

    def _refit_due(self) -> bool:
        """The first fit at min_keys keys; then a refit each time the memory has doubled, up to
        REFIT_LIMIT keys while a basis holds (a refit projects every key again: a pause of about
        0.5 s at 512K keys, in the middle of a prefill or a decode step), and beyond only when
        the keys since the last fit have drifted out of the basis."""
        if self.n_keys < self.min_keys:
            return False
        if self.fitted_at == 0 or (
            self.n_keys >= 2 * self.fitted_at and (self.basis is None or self.n_keys <= REFIT_LIMIT)
        ):
            return True
        count, energy, residual = self._since_fit
        return self.basis is not None and count >= DRIFT_MIN_KEYS and bool(residual > DRIFT * RESIDUAL_ENERGY * energy)

    def truncate(self, n: int) -> None:
        """Forget every key from the n-th on (the basis and the norm bound stay valid)."""
        self.n_keys = min(self.n_keys, n)
        self.coords.truncate(n)
        self.residuals.truncate(n)


def _topk_one_row(
    q: torch.Tensor,
    keys: torch.Tensor,
    basis: torch.Tensor,
    coords: torch.Tensor,
    residuals: torch.Tensor,
    max_norm: torch.Tensor,
    k: int,
    start: int,
    stop: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch row: q [m, D] scaled queries in the score dtype, keys [n, D], basis [r, D],
    coords [n, r] and residuals [n] of the keys, max_norm >= every |k_j| -> (index, exact scores)."""
    rank, dim = basis.shape
    plain = q.detach()
    q_r = plain @ basis.t()  # [m, r]
    q_perp = (plain - q_r @ basis).norm(dim=1)  # [m]
    group_max = group_maxima(q_r, coords, start, stop, GROUP)  # [m, n_groups]
    n_groups = group_max.shape[1]
    rho = F.pad(residuals, (0, n_groups * GROUP - keys.shape[0])).view(n_groups, GROUP).amax(dim=1)  # [n_groups]
    # Rounding, with u the unit roundoff: the computed q_r, k_r, residuals and their norms
    # decompose q and k only up to O((D + r) u) |q| |k| in the dot product (P is orthonormal up
    # to O(D u), the r-dim GEMM adds r u |q_r| |k_r|), and each norm is off by O(D u) relative;
    # the margin takes twice the sum of those worst cases.
    u = torch.finfo(q.dtype).eps / 2
    margin = 8 * (dim + rank + 4) * u * plain.norm(dim=1) * max_norm  # [m]
    error = torch.addcmul(margin[:, None], q_perp[:, None], rho[None], value=1 + 4 * dim * u)  # [m, n_groups], one pass
    return topk_from_groups(q, keys, group_max, error, k, start, stop, GROUP)


def retrieval_topk_lowrank(
    query: torch.Tensor,
    keys: torch.Tensor,
    k: int,
    start: torch.Tensor,
    stop: torch.Tensor,
    scale: float,
    low_rank: LowRankKeys | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as retrieval_topk_reference. low_rank: the keys' LowRankKeys (a long-lived
    memory keeps one as it grows), fitted here when not given. Keys without a low-rank basis
    and non-finite inputs take the reference path."""
    if keys.shape[1] == 0 or query.shape[1] == 0:  # nothing to screen
        return retrieval_topk_reference(query, keys, k, start, stop, scale)
    dtype = score_dtype(query.dtype)
    with torch.autocast(query.device.type, enabled=False):
        if low_rank is None:
            low_rank = LowRankKeys()
            low_rank.update(keys)
        elif low_rank.n_keys != keys.shape[1]:
            raise InputError(
                f"low_rank covers {low_rank.n_keys} keys, keys has {keys.shape[1]}; update it with the memory's keys"
            )
        q = query.to(dtype) * scale
        if low_rank.basis is None or not bool(torch.isfinite(low_rank.max_norm)) or not bool(torch.isfinite(q).all()):
            return retrieval_topk_reference(query, keys, k, start, stop, scale)
        basis, coords, residuals = (
            x.to(dtype) for x in (low_rank.basis, low_rank.coords.view(), low_rank.residuals.view())
        )
        max_norm = low_rank.max_norm.to(dtype)
        results = [
            _topk_one_row(q[b], keys[b], basis[b], coords[b], residuals[b], max_norm, k, int(start[b]), stop)
            for b in range(query.shape[0])
        ]
    return torch.stack([r[0] for r in results]), torch.stack([r[1] for r in results])
