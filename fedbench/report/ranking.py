"""Ranking several methods over several blocks (data sets, federations): average ranks, the
Friedman test, and the Nemenyi post-hoc test with its critical difference, as Demšar
recommends for comparing classifiers over data sets:

    J. Demšar, "Statistical Comparisons of Classifiers over Multiple Data Sets", JMLR 7
    (2006) 1-30, Section 3.2.2.

In each block the methods are ranked (1 = the highest score; tied scores share the mean of
their ranks); R_j is method j's average rank over the N blocks, k the number of methods.

- Friedman: chi2_F = 12 N / (k (k + 1)) * (sum_j R_j^2 - k (k + 1)^2 / 4), chi-square with
  k - 1 degrees of freedom; Iman and Davenport's F_F = (N - 1) chi2_F / (N (k - 1) - chi2_F),
  F-distributed with k - 1 and (k - 1)(N - 1) degrees of freedom (Demšar's eq. for F_F: less
  conservative than chi2_F).
- Nemenyi: two methods differ significantly when their average ranks differ by at least the
  critical difference CD = q_alpha sqrt(k (k + 1) / (6 N)), q_alpha the studentized range
  statistic for k means and infinite degrees of freedom divided by sqrt(2) (Demšar's Table 5).

Everything here is numpy and the standard library: the chi-square and F tail probabilities
are the regularized incomplete gamma and beta functions (continued fractions, as in Numerical
Recipes, 6.2 and 6.4), q_alpha the quantile of the range of k standard normals, whose
distribution function k * int phi(z) (Phi(z) - Phi(z - q))^(k-1) dz is integrated on a grid;
tests/test_leaderboard.py holds them to Demšar's tables and worked example. scipy is not needed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import numpy as np

_TINY = 1e-300
_EPS = 1e-15
_MAX_ITER = 10_000


# --------------------------------------------------------------------------- distributions
def _gamma_series(a: float, x: float) -> float:
    """P(a, x), the regularized lower incomplete gamma, by its series (x < a + 1)."""
    term = total = 1.0 / a
    n = a
    for _ in range(_MAX_ITER):
        n += 1.0
        term *= x / n
        total += term
        if abs(term) < abs(total) * _EPS:
            break
    return total * math.exp(-x + a * math.log(x) - math.lgamma(a))


def _gamma_fraction(a: float, x: float) -> float:
    """Q(a, x) = 1 - P(a, x) by its continued fraction (modified Lentz; x >= a + 1)."""
    b = x + 1.0 - a
    c = 1.0 / _TINY
    d = 1.0 / b
    h = d
    for i in range(1, _MAX_ITER):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = _TINY if abs(d) < _TINY else d
        c = b + an / c
        c = _TINY if abs(c) < _TINY else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < _EPS:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


def chi2_sf(x: float, df: float) -> float:
    """P(X >= x) for X chi-square with `df` degrees of freedom: Q(df / 2, x / 2)."""
    if df <= 0:
        raise ValueError(f"df={df}: must be > 0")
    if x <= 0:
        return 1.0
    a, h = df / 2.0, x / 2.0
    return 1.0 - _gamma_series(a, h) if h < a + 1.0 else _gamma_fraction(a, h)


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (_TINY if abs(d) < _TINY else d)
    h = d
    for m in range(1, _MAX_ITER):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                   -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):  # fmt: skip
            d = 1.0 + aa * d
            d = 1.0 / (_TINY if abs(d) < _TINY else d)
            c = 1.0 + aa / c
            c = _TINY if abs(c) < _TINY else c
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_fraction(a, b, x) / a
    return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b


def f_sf(x: float, df1: float, df2: float) -> float:
    """P(X >= x) for X F-distributed with (df1, df2) degrees of freedom."""
    if df1 <= 0 or df2 <= 0:
        raise ValueError(f"df=({df1}, {df2}): both must be > 0")
    if x <= 0:
        return 1.0
    if math.isinf(x):
        return 0.0
    return betainc(df2 / 2.0, df1 / 2.0, df2 / (df2 + df1 * x))


def _erfc(x: np.ndarray) -> np.ndarray:
    """erfc, vectorized: Numerical Recipes' Chebyshev fit (6.2), relative error < 1.2e-7."""
    a = np.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (
        -0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (
            -0.82215223 + t * 0.17087277))))))))  # fmt: skip
    ans = t * np.exp(-a * a + poly)
    return np.where(x >= 0, ans, 2.0 - ans)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * _erfc(-z / math.sqrt(2.0))


_GRID = np.linspace(-9.0, 9.0, 3601)  # step 0.005: the integrand is smooth and ~0 beyond


def range_cdf(q: float, k: int) -> float:
    """P(max - min of k independent standard normals <= q)."""
    if q <= 0:
        return 0.0
    z = _GRID
    phi = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    inner = np.clip(_normal_cdf(z) - _normal_cdf(z - q), 0.0, 1.0)
    y = k * phi * inner ** (k - 1)
    return float(np.sum((y[1:] + y[:-1]) * np.diff(z)) / 2.0)


@cache
def q_alpha(k: int, alpha: float = 0.05) -> float:
    """Demšar's q_alpha for k methods: the (1 - alpha) quantile of the studentized range
    of k means with infinite degrees of freedom, divided by sqrt(2) (his Table 5a:
    1.960, 2.343, 2.569, ... for k = 2, 3, 4, ... at alpha 0.05)."""
    if k < 2:
        raise ValueError(f"k={k}: at least 2 methods")
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha}: in (0, 1)")
    lo, hi = 0.0, 20.0
    for _ in range(60):  # bisection: 20 / 2^60, far below the grid's accuracy
        mid = (lo + hi) / 2.0
        if range_cdf(mid, k) < 1.0 - alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2.0 / math.sqrt(2.0)


# --------------------------------------------------------------------------- the tests
def block_ranks(scores: np.ndarray) -> np.ndarray:
    """Ranks within each row of `scores` (blocks x methods): 1 = the highest score; equal
    scores share the mean of the ranks they span."""
    scores = np.asarray(scores, dtype=float)
    out = np.empty_like(scores)
    for i, row in enumerate(scores):
        order = np.argsort(-row, kind="mergesort")
        ranks = np.empty(row.size)
        ranks[order] = np.arange(1, row.size + 1, dtype=float)
        for v in np.unique(row):
            tied = row == v
            ranks[tied] = ranks[tied].mean()
        out[i] = ranks
    return out


@dataclass(frozen=True)
class Friedman:
    """Average ranks and the Friedman test of N blocks x k methods (Demšar, Section 3.2.2)."""

    k: int
    n: int
    avg_ranks: tuple[float, ...]
    chi2: float
    p_chi2: float
    ff: float  # Iman and Davenport's F_F
    p_ff: float
    df1: int
    df2: int

    def cd(self, alpha: float = 0.05) -> float:
        return critical_difference(self.k, self.n, alpha)


def friedman_from_ranks(avg_ranks: np.ndarray | list[float], n: int) -> Friedman:
    """The Friedman statistics from the average ranks R_j of k methods over n blocks."""
    r = np.asarray(avg_ranks, dtype=float)
    k = r.size
    if k < 2 or n < 2:
        raise ValueError(f"k={k}, N={n}: the test needs at least 2 methods and 2 blocks")
    chi2 = 12.0 * n / (k * (k + 1)) * (float(np.sum(r**2)) - k * (k + 1) ** 2 / 4.0)
    chi2 = max(chi2, 0.0)  # rounding of equal ranks
    df1, df2 = k - 1, (k - 1) * (n - 1)
    denom = n * (k - 1) - chi2
    ff = math.inf if denom <= 1e-12 * n * k else (n - 1) * chi2 / denom  # inf: one order in all
    return Friedman(
        k=k,
        n=n,
        avg_ranks=tuple(float(v) for v in r),
        chi2=chi2,
        p_chi2=chi2_sf(chi2, df1),
        ff=ff,
        p_ff=f_sf(ff, df1, df2),
        df1=df1,
        df2=df2,
    )


def friedman(scores: np.ndarray) -> Friedman:
    """The Friedman test of `scores` (blocks x methods, higher is better)."""
    scores = np.asarray(scores, dtype=float)
    if scores.ndim != 2 or not np.isfinite(scores).all():
        raise ValueError("scores: a complete blocks x methods table of numbers")
    return friedman_from_ranks(block_ranks(scores).mean(axis=0), scores.shape[0])


def critical_difference(k: int, n: int, alpha: float = 0.05) -> float:
    """Nemenyi's CD = q_alpha sqrt(k (k + 1) / (6 N))."""
    return q_alpha(k, alpha) * math.sqrt(k * (k + 1) / (6.0 * n))


def cliques(avg_ranks: list[float] | tuple[float, ...], cd: float) -> list[tuple[int, int]]:
    """The groups a critical-difference diagram joins with a bar: in the order of the
    average ranks, the maximal runs (first, last position, at least two methods) whose
    extreme ranks differ by less than `cd` (no significant difference inside)."""
    r = sorted(avg_ranks)
    out: list[tuple[int, int]] = []
    for i in range(len(r)):
        j = i
        while j + 1 < len(r) and r[j + 1] - r[i] < cd:
            j += 1
        if j > i and not any(a <= i and j <= b for a, b in out):
            out.append((i, j))
    return out
