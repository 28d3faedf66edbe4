"""Peak memory and time of the per-token distillation divergence on CPU: full logits vs chunked implementations.

Each measurement runs in a fresh subprocess. Peak memory is the growth of the process's resident set (Linux
`VmHWM - VmRSS`, with the high-water mark reset through `/proc/self/clear_refs` right before the forward pass), so it
counts every tensor and temporary of one forward + backward, not only those of a Python-visible allocator. Each setting
is measured twice: with glibc's default allocator settings (what a user gets; freed buffers of up to 32 MiB may stay
in the heap and count) and with `MALLOC_MMAP_THRESHOLD_=65536` (every large buffer is returned to the system when
freed, so the number is close to the peak of live tensors).

Usage:

```bash
python benchmarks/chunked_jsd_memory.py --vocab_sizes 32000 151936 --num_tokens 2048
```
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


METHODS = ("full_logits", "trl_default_tiles", "trl_small_tiles", "checkpoint_chunks", "memopd_chunked")


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def _run_one(method: str, vocab_size: int, num_tokens: int, chunk_size: int, beta: float) -> dict:
    import torch
    import torch.utils.checkpoint

    from memopd_trl.losses import chunked_generalized_jsd, generalized_jsd_loss

    torch.manual_seed(0)
    torch.set_num_threads(2)
    student_hidden_size, teacher_hidden_size = 256, 384
    student_hidden = torch.randn(num_tokens, student_hidden_size, requires_grad=True)  # (N, H_s)
    student_weight = (0.05 * torch.randn(vocab_size, student_hidden_size)).requires_grad_()  # (V, H_s)
    teacher_hidden = torch.randn(num_tokens, teacher_hidden_size)  # (N, H_t)
    teacher_weight = 0.05 * torch.randn(vocab_size, teacher_hidden_size)  # (V, H_t)

    def divergence() -> torch.Tensor:
        if method == "full_logits":
            student_logits = student_hidden @ student_weight.T  # (N, V)
            with torch.no_grad():
                teacher_logits = teacher_hidden @ teacher_weight.T  # (N, V)
            return generalized_jsd_loss(student_logits, teacher_logits, beta=beta, reduction="none").sum(-1)
        if method in ("trl_default_tiles", "trl_small_tiles"):
            from trl.kernels import chunked_divergence

            if method == "trl_small_tiles":
                chunked_divergence.TOKEN_CHUNK_SIZE = chunk_size
                chunked_divergence.VOCAB_CHUNK_SIZE = 4096
            function = chunked_divergence.ChunkedDivergenceFunction
            return function.apply(student_hidden, student_weight, None, teacher_hidden, teacher_weight, None, beta)[0]
        if method == "checkpoint_chunks":

            def chunk_divergence(hidden, weight, teacher_chunk):
                with torch.no_grad():
                    teacher_logits = teacher_chunk @ teacher_weight.T  # (chunk, V)
                logits = hidden @ weight.T  # (chunk, V)
                return generalized_jsd_loss(logits, teacher_logits, beta=beta, reduction="none").sum(-1)

            chunks = [
                torch.utils.checkpoint.checkpoint(
                    chunk_divergence,
                    student_hidden[start : start + chunk_size],
                    student_weight,
                    teacher_hidden[start : start + chunk_size],
                    use_reentrant=False,
                )
                for start in range(0, num_tokens, chunk_size)
            ]
            return torch.cat(chunks)
        return chunked_generalized_jsd(
            student_hidden, student_weight, teacher_hidden, teacher_weight, beta=beta, chunk_size=chunk_size
        )

    baseline_kib = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident set
    start = time.perf_counter()
    per_token = divergence()  # (N,)
    per_token.sum().backward()
    seconds = time.perf_counter() - start
    peak_kib = _rss_kib("VmHWM")
    return {
        "method": method,
        "vocab_size": vocab_size,
        "num_tokens": num_tokens,
        "chunk_size": chunk_size,
        "peak_mib": (peak_kib - baseline_kib) / 1024,
        "seconds": seconds,
        "loss": float(per_token.detach().sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab_sizes", type=int, nargs="+", default=[32000, 151936])
    parser.add_argument("--num_tokens", type=int, default=2048)
    parser.add_argument("--chunk_sizes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--beta", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=1, help="runs per setting; the median time is reported")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--max_full_logits_elements", type=float, default=1.0e8, help="skip larger naive runs")
    parser.add_argument("--_child", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args._child is not None:
        print(json.dumps(_run_one(**json.loads(args._child))))
        return

    print(
        "| method | vocab | tokens | chunk | peak MiB (glibc default) | peak MiB (mmap threshold 64 KiB) | seconds |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for vocab_size in args.vocab_sizes:
        for method in args.methods:
            chunked = method in ("trl_small_tiles", "checkpoint_chunks", "memopd_chunked")
            for chunk_size in args.chunk_sizes if chunked else [0]:
                if method == "full_logits" and vocab_size * args.num_tokens > args.max_full_logits_elements:
                    continue
                setting = {
                    "method": method,
                    "vocab_size": vocab_size,
                    "num_tokens": args.num_tokens,
                    "chunk_size": chunk_size,
                    "beta": args.beta,
                }
                peaks = {}
                times = []
                for allocator, extra_env in (("default", {}), ("mmap", {"MALLOC_MMAP_THRESHOLD_": "65536"})):
                    results = []
                    for _ in range(args.repeats):
                        child = subprocess.run(
                            [sys.executable, __file__, "--_child", json.dumps(setting)],
                            capture_output=True,
                            text=True,
                            check=True,
                            env={**os.environ, **extra_env},
                        )
                        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
                    peaks[allocator] = max(result["peak_mib"] for result in results)
                    if allocator == "default":
                        times = [result["seconds"] for result in results]
                chunk = chunk_size if chunked else "-"
                print(
                    f"| {method} | {vocab_size} | {args.num_tokens} | {chunk} | {peaks['default']:.0f} | "
                    f"{peaks['mmap']:.0f} | {statistics.median(times):.2f} |"
                )
                sys.stdout.flush()


if __name__ == "__main__":
    main()
