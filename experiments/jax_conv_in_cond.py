"""A convolution's gradient jitted as is and inside a `lax.cond`, on the default JAX backend
(docs/jax.md; NOTE [ Convolutions inside a conditional on XLA:CPU ]): the fenced executor
runs a recomputed segment and its backward inside one.

    OMP_NUM_THREADS=1 XLA_FLAGS="--xla_cpu_multi_thread_eigen=false \
intra_op_parallelism_threads=1" python experiments/jax_conv_in_cond.py

Prints the median of 7 warm calls of each (after one that compiles).
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax


def conv(x, w, layout: str):
    numbers = ("NCHW", "OIHW", "NCHW") if layout == "NCHW" else ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=numbers)


def median_ms(fn, *args) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(7):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    print(f"backend {jax.default_backend()}; gradient of one 3x3 convolution, 8 x 32 x 32 x 32")
    print("| layout | jitted as is, ms | inside lax.cond, ms | ratio |")
    print("|---|---:|---:|---:|")
    for layout in ("NCHW", "NHWC"):
        x = jnp.ones((8, 32, 32, 32))
        w = jnp.ones((32, 32, 3, 3)) if layout == "NCHW" else jnp.ones((3, 3, 32, 32))
        grad = jax.grad(lambda w, x, layout=layout: (conv(x, w, layout) ** 2).sum())

        def in_cond(w, x, grad=grad):
            unknown = jax.random.uniform(jax.random.key(0)) < 2  # as the fenced predicate
            return lax.cond(unknown, lambda a: grad(*a), lambda a: jnp.zeros_like(a[0]), (w, x))

        plain, fenced = median_ms(jax.jit(grad), w, x), median_ms(jax.jit(in_cond), w, x)
        print(f"| {layout} | {plain:.1f} | {fenced:.1f} | {fenced / plain:.1f}x |")


if __name__ == "__main__":
    main()
