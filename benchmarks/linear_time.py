"""Benchmark: the two pieces of work that must stay linear in their input, timed at growing sizes.

- `parse_action` on degenerate generations (hundreds of kB of unclosed tags). A regular-expression scan retried from
  every unclosed tag took 16 s on 128 kB of "<memory>" (quadratic); the linear scan's time doubles with the input.
- `make_synthetic_world` (the offline lab's world) at 25k, 50k and 100k questions.

    python benchmarks/linear_time.py

Prints one line per size, and the ratio of the largest size's time to the smallest's next to the size ratio (linear:
about equal). Numbers: docs/benchmarks.md ("Linear-time parsing and world building").
"""

import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.envs.base import ActionFormat, parse_action  # noqa: E402
from offline_lab import make_synthetic_world  # noqa: E402


def timed(function, *args, repeats: int = 3, **kwargs) -> float:
    """The best of `repeats` wall-clock times of `function(*args, **kwargs)`, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args, **kwargs)
        best = min(best, time.perf_counter() - start)
    return best


def report(name: str, sizes: list[int], seconds: list[float]) -> None:
    for size, value in zip(sizes, seconds, strict=True):
        print(f"{name:<32} size {size:>9,}: {value:8.3f} s")
    print(f"{name:<32} time ratio {seconds[-1] / seconds[0]:.2f} for a size ratio of {sizes[-1] / sizes[0]:.0f}\n")


def main() -> None:
    action_format = ActionFormat()
    for pattern in ("<memory>", "</memory><memory>"):
        sizes = [16_000, 32_000, 64_000]
        seconds = [timed(parse_action, pattern * n, action_format) for n in sizes]
        report(f"parse_action {pattern!r} x n", [n * len(pattern) for n in sizes], seconds)
    sizes = [25_000, 50_000, 100_000]
    seconds = [timed(make_synthetic_world, n, seed=0, repeats=1) for n in sizes]
    report("make_synthetic_world(n)", sizes, seconds)


if __name__ == "__main__":
    main()
