"""Example launch job: evaluate a fixed classifier on freshly generated data."""

from __future__ import annotations

import numpy as np
from prefect import flow, get_run_logger


@flow(name="evaluate", log_prints=True)
def evaluate(n_samples: int = 5000, noise: float = 0.5, threshold: float = 0.0, seed: int = 1) -> dict:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_samples, 2))
    y = (x[:, 0] + x[:, 1] > 0).astype(int)
    scores = x[:, 0] + x[:, 1] + noise * rng.normal(size=n_samples)
    pred = (scores > threshold).astype(int)
    tp = int(((pred == 1) & (y == 1)).sum())
    fp = int(((pred == 1) & (y == 0)).sum())
    fn = int(((pred == 0) & (y == 1)).sum())
    metrics = {
        "accuracy": float((pred == y).mean()),
        "precision": tp / max(1, tp + fp),
        "recall": tp / max(1, tp + fn),
    }
    get_run_logger().info("evaluation: %s", metrics)
    return metrics
