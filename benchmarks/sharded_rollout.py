"""
The cost of generating with an FSDP2-sharded student: gathering it once per rollout, against decoding on shards.

    python -m torch.distributed.run --nproc_per_node 2 benchmarks/sharded_rollout.py [--hidden 1024 --layers 12]

On every process, a Qwen2-shaped model with random weights is sharded as the trainer shards the student (each decoder
layer, then the model). Timed, interleaved over `--repeats` rounds:

- `gather`: entering and leaving `memopd_trl.sharding.gathered_for_generation` (what each rollout pays);
- `gathered generate`: `generate` of `--new_tokens` tokens for `--batch` prompts inside that context;
- `sharded generate`: the same `generate` on the shards, where every decoding step all-gathers every layer. (The
  trainer cannot do this: processes decode different numbers of tokens. Here every process decodes exactly
  `--new_tokens`, so it runs.)

Prints the medians, in seconds, on rank 0.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.sharding import gathered_for_generation  # noqa: E402
from offline_lab import build_tiny_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new_tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    model = build_tiny_model(args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                             num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 256),
                             seed=0).eval()  # fmt: skip
    parameters = sum(p.numel() for p in model.parameters())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    prompts = torch.randint(1, args.vocab, (args.batch, args.prompt), generator=torch.Generator().manual_seed(0))
    generation = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    times = {"gather": [], "gathered generate": [], "sharded generate": []}
    with torch.no_grad():
        model.generate(prompts, **dict(generation, max_new_tokens=2, min_new_tokens=2))  # lazy init, warm-up
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            with gathered_for_generation(model):
                gathered = time.perf_counter()
                model.generate(prompts, **generation)
                generated = time.perf_counter()
            end = time.perf_counter()
            times["gather"].append((gathered - start) + (end - generated))
            times["gathered generate"].append(generated - gathered)
            dist.barrier()
            start = time.perf_counter()
            model.generate(prompts, **generation)
            times["sharded generate"].append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        print(f"{parameters / 1e6:.0f}M parameters fp32, {dist.get_world_size()} processes, {args.batch} prompts x "
              f"{args.prompt} tokens, {args.new_tokens} new tokens, median of {args.repeats}:")  # fmt: skip
        for name, values in times.items():
            print(f"  {name}: {statistics.median(values):.3f} s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
