"""When each request is sent: a Poisson process, or a gamma process for burstier traffic."""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0,
                    rng: np.random.Generator | None = None) -> np.ndarray:
    """Send times in seconds from the start for `n` requests.

    The gaps between requests are gamma-distributed with shape `burstiness` and mean
    1 / `request_rate`: shape 1 is a Poisson process (exponential gaps); below 1 requests come in
    bursts, above 1 they are more evenly spaced (coefficient of variation 1 / sqrt(shape)).
    An infinite rate sends everything at once. The first request goes at time 0.
    """
    if n < 0:
        raise ValueError("n must be >= 0")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness (the gamma shape of the arrival gaps) must be a finite number > 0, "
                         f"not {burstiness:g}")
    if not request_rate > 0:
        raise ValueError(f"request rate must be > 0 (inf: all at once), not {request_rate:g}")
    if n == 0 or math.isinf(request_rate):
        return np.zeros(n)
    rng = rng if rng is not None else np.random.default_rng()
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):  # checked just below
        scale = np.float64(1.0) / (np.float64(request_rate) * burstiness)
        gaps = rng.gamma(shape=burstiness, scale=scale, size=n - 1)
        offsets = np.concatenate(([0.0], np.cumsum(gaps)))
    if not np.all(np.isfinite(offsets)):
        # e.g. a tiny rate times a tiny burstiness: the gaps' scale overflows
        raise ValueError(f"request rate {request_rate:g} with burstiness {burstiness:g} gives send times "
                         "that are not finite numbers (the arrival gaps' scale overflows)")
    return offsets
