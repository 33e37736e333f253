"""The sampler's ranking of the vocabulary: the top k without sorting the whole of it, exactly as a stable sort."""

from __future__ import annotations

import numpy as np

from tokenwing.runtime.sampler import Sampler, SamplerSettings, _ranked


def test_top_k_ranking_equals_a_stable_sort() -> None:
    """Random logits, logits full of ties (a stable sort takes the lowest ids of a tie at the k-th place),
    masked (-inf) ones, and k of 0 (every token), 1, the vocabulary and more."""
    rng = np.random.default_rng(1)
    for trial in range(2000):
        n = int(rng.integers(1, 300))
        if trial % 3 == 0:
            z = rng.integers(-3, 4, n).astype(np.float64)
        elif trial % 3 == 1:
            z = rng.standard_normal(n)
            z[rng.random(n) < 0.5] = -np.inf
        else:
            z = rng.standard_normal(n)
        k = int(rng.integers(0, n + 3))
        want = np.argsort(-z, kind="stable")
        assert np.array_equal(_ranked(z, k), want[:k] if k > 0 else want), (n, k)


def test_seeded_samples_as_before() -> None:
    """A seed gives the token that ranking by a full stable sort gave (the sampler before this ranking, written
    out here): seeded replies are what they were."""
    z = np.random.default_rng(3).standard_normal(5000) * 3
    settings = SamplerSettings(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    got = [Sampler(settings).sample(z) for _ in range(2)]
    order = np.argsort(-z, kind="stable")[:40]
    vals = z[order]
    p = np.exp(vals - vals[0])
    p /= p.sum()
    keep = int(np.searchsorted(np.cumsum(p), 0.95) + 1)
    order, vals = order[:keep], vals[:keep]
    q = np.exp((vals - vals[0]) / 0.8)
    q /= q.sum()
    want = int(order[np.random.default_rng(7).choice(len(order), p=q)])
    assert got == [want, want]


def test_a_temperature_near_zero_samples_the_top_without_a_warning() -> None:
    """Issue 41: sampler.py warned "overflow encountered in divide" (the gaps below the top over a tiny
    temperature go to -inf: those tokens' weights are 0, as in the limit, which is no fault to print)."""
    import warnings

    logits = np.array([0.0, 5.0, 4.0, -3.0], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        picks = {Sampler(SamplerSettings(temperature=1e-308, top_k=0, seed=s)).sample(logits) for s in range(8)}
    assert picks == {1}
