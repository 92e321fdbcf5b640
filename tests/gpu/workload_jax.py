"""Deterministic JAX training loop (run with XLA_FLAGS=--xla_gpu_deterministic_ops=true): an MLP trained with
plain SGD on batches derived from the step number, a magic value kept in device memory.

Prints `step <i> loss <float.hex>` per step (two runs compare bit for bit), then `MAGIC OK|BAD` and `DONE`.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp

MAGIC = 0x5EEDC0FF


def init(key, sizes):
    params = []
    for n_in, n_out in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append((jax.random.normal(k, (n_in, n_out), jnp.float32) / jnp.sqrt(n_in), jnp.zeros(n_out)))
    return params


def forward(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def loss_fn(params, x, y):
    logits = forward(params, x)
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, 10), axis=1))


@jax.jit
def train_step(params, key, step, target_w):
    x = jax.random.normal(jax.random.fold_in(key, step), (1024, 512), jnp.float32)
    y = jnp.argmax(x @ target_w, axis=1)
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    params = jax.tree_util.tree_map(lambda p, g: p - 0.05 * g, params, grads)
    return params, loss


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--magic-mib", type=int, default=256)
    a = ap.parse_args()
    key = jax.random.PRNGKey(1234)
    params = init(key, [512, 2048, 2048, 10])
    target_w = jax.random.normal(jax.random.PRNGKey(42), (512, 10), jnp.float32)
    magic = jnp.full((a.magic_mib << 18,), MAGIC, dtype=jnp.uint32)
    print(f"READY pid={os.getpid()} devices={jax.devices()}", flush=True)
    for step in range(a.steps):
        params, loss = train_step(params, key, step, target_w)
        print(f"step {step} loss {float(loss).hex()}", flush=True)
        if a.sleep:
            time.sleep(a.sleep)
    ok = bool(jnp.all(magic == MAGIC))
    print(f"MAGIC {'OK' if ok else 'BAD'} {magic.size * 4} bytes of {MAGIC:#x}", flush=True)
    print("DONE", flush=True)
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
