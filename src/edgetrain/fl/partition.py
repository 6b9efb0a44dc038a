"""Split a labelled data set across federated clients: IID shards or label-skewed Dirichlet shards.

Pure NumPy on label arrays, so the same partition is drawn from the same seed on every process (each
Flower ClientApp computes its own partition from ``partition-id`` and gets the same indices the server's
report used).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["iid_partition", "dirichlet_partition", "partition", "label_histogram"]


def iid_partition(num_samples: int, num_clients: int, seed: int = 0) -> list[np.ndarray]:
    """Shuffle ``range(num_samples)`` and cut it into ``num_clients`` shards of (almost) equal size.

    Args:
        num_samples: number of samples to split.
        num_clients: number of shards (>= 1, at most ``num_samples``).
        seed: seed of the shuffle.

    Returns:
        One sorted int64 index array per client; together they cover every sample exactly once.

    Raises:
        ValueError: ``num_clients`` is below 1 or above ``num_samples``.
    """
    if not 1 <= num_clients <= num_samples:
        raise ValueError(f"need 1 <= num_clients <= num_samples, got {num_clients} clients for {num_samples}")
    order = np.random.default_rng(seed).permutation(num_samples)
    return [np.sort(s).astype(np.int64) for s in np.array_split(order, num_clients)]


def dirichlet_partition(labels: Sequence[int] | np.ndarray, num_clients: int, alpha: float = 0.5,
                        seed: int = 0, min_samples: int = 10, max_tries: int = 100) -> list[np.ndarray]:
    """Label-skewed shards: each class is split across clients in proportions drawn from Dir(alpha).

    The usual non-IID benchmark split (Hsu et al., 2019): small ``alpha`` gives each client a few
    dominant classes. Draws are repeated (same generator, so still deterministic) until every client
    holds at least ``min_samples`` samples.

    Args:
        labels: the class label of every sample.
        num_clients: number of shards.
        alpha: Dirichlet concentration (> 0); large values approach IID.
        seed: seed of the draws.
        min_samples: the least number of samples a client may get.
        max_tries: draws before giving up.

    Returns:
        One sorted int64 index array per client; together they cover every sample exactly once.

    Raises:
        ValueError: ``alpha`` is not positive, or no draw in ``max_tries`` gives every client
            ``min_samples`` samples (lower it, or raise ``alpha``).
    """
    y = np.asarray(labels)
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if num_clients < 1 or num_clients * min_samples > y.size:
        raise ValueError(f"{y.size} samples cannot give {num_clients} clients {min_samples} each")
    rng = np.random.default_rng(seed)
    for _ in range(max_tries):
        shards: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c in np.unique(y):
            idx = rng.permutation(np.flatnonzero(y == c))
            share = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(share)[:-1] * idx.size).astype(int)
            for k, part in enumerate(np.split(idx, cuts)):
                shards[k].append(part)
        out = [np.sort(np.concatenate(s)).astype(np.int64) for s in shards]
        if min(s.size for s in out) >= min_samples:
            return out
    raise ValueError(f"no Dirichlet({alpha}) draw in {max_tries} tries gave every one of {num_clients} clients "
                     f"{min_samples} samples; lower min_samples or raise alpha")


def partition(labels: Sequence[int] | np.ndarray, num_clients: int, scheme: str = "iid", *, alpha: float = 0.5,
              seed: int = 0) -> list[np.ndarray]:
    """:func:`iid_partition` (``scheme="iid"``) or :func:`dirichlet_partition` (``scheme="dirichlet"``).

    Raises:
        ValueError: an unknown scheme.
    """
    if scheme == "iid":
        return iid_partition(len(labels), num_clients, seed)
    if scheme == "dirichlet":
        return dirichlet_partition(labels, num_clients, alpha=alpha, seed=seed)
    raise ValueError(f"unknown partition scheme {scheme!r}; use 'iid' or 'dirichlet'")


def label_histogram(labels: Sequence[int] | np.ndarray, shards: Sequence[np.ndarray],
                    num_classes: int) -> np.ndarray:
    """``[num_clients, num_classes]`` counts of each class in each shard (for reports)."""
    y = np.asarray(labels)
    return np.stack([np.bincount(y[s], minlength=num_classes) for s in shards])
