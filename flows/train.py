"""Example launch job: train a small two-layer network on data it makes itself.

Plain Prefect + NumPy; it imports nothing from prefect-launch, yet its CPU,
memory and GPU use are measured by the agent from outside.
"""

from __future__ import annotations

import os
import time

import numpy as np
from prefect import flow, get_run_logger, task


@task
def make_data(n_samples: int, n_features: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_samples, n_features))
    w = rng.normal(size=n_features)
    y = (x @ w + 0.3 * rng.normal(size=n_samples) > 0).astype(float)
    return x, y


@task
def fit(x: np.ndarray, y: np.ndarray, epochs: int, lr: float, hidden: int, seed: int) -> dict:
    rng = np.random.default_rng(seed + 1)
    w1 = rng.normal(scale=0.5, size=(x.shape[1], hidden))
    w2 = rng.normal(scale=0.5, size=hidden)
    losses = []
    for _ in range(epochs):
        h = np.tanh(x @ w1)
        p = 1 / (1 + np.exp(-(h @ w2)))
        loss = float(-np.mean(y * np.log(p + 1e-9) + (1 - y) * np.log(1 - p + 1e-9)))
        losses.append(loss)
        g = (p - y) / len(y)
        grad_w2 = h.T @ g
        grad_w1 = x.T @ ((g[:, None] * w2) * (1 - h**2))
        w1 -= lr * grad_w1
        w2 -= lr * grad_w2
    acc = float(np.mean(((1 / (1 + np.exp(-(np.tanh(x @ w1) @ w2)))) > 0.5) == y))
    return {"first_loss": losses[0], "final_loss": losses[-1], "accuracy": acc}


@flow(name="train", log_prints=True)
def train(epochs: int = 200, lr: float = 0.5, n_samples: int = 4000, n_features: int = 20,
          hidden: int = 32, seed: int = 0, hold_seconds: float = 0.0) -> dict:
    """Train and report loss and accuracy; ``hold_seconds`` keeps the run busy longer (demos)."""
    logger = get_run_logger()
    logger.info("devices CUDA_VISIBLE_DEVICES=%r threads OMP_NUM_THREADS=%r",
                os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("OMP_NUM_THREADS"))
    x, y = make_data(n_samples, n_features, seed)
    result = fit(x, y, epochs, lr, hidden, seed)
    deadline = time.time() + hold_seconds
    while time.time() < deadline:  # keep one core busy, as a real training step would
        np.tanh(np.random.default_rng().normal(size=(200, 200)) @ np.ones((200, 200)))
    logger.info("trained: %s", result)
    return result


if __name__ == "__main__":
    print(train(epochs=20))
