"""
Per-GPU memory of MemOPD training under DDP, ZeRO-2, ZeRO-3 and FSDP2: a model of the bytes, not a measurement.

    python benchmarks/sharding_memory.py                       # Qwen2.5-3B student + Qwen2.5-7B teacher, 8 GPUs
    python benchmarks/sharding_memory.py --gpus 16 --max_tokens_per_row 16384

Parameter counts are exact: each model is built from its configuration on the meta device (no weights, offline).
The bytes per parameter follow the recipe docs/scaling.md recommends: the student in float32 with bf16 mixed precision
and AdamW, the teacher loaded in bf16 and never trained.

| strategy | student weights | gradients | optimizer (AdamW m, v) | teacher |
| --- | --- | --- | --- | --- |
| DDP | fp32, whole (4 P) | fp32, whole (4 P) | fp32, whole (8 P) | bf16, whole (2 T) |
| ZeRO-2 | bf16 whole (2 P) + fp32 master shard (4 P / n) | bf16 shard (2 P / n) | 8 P / n | whole (2 T): TRL's `prepare_deepspeed` runs stage 0 for stages < 3 |
| ZeRO-3 | bf16 shard (2 P / n) + fp32 master shard (4 P / n) | bf16 shard (2 P / n) | 8 P / n | bf16 shard (2 T / n) |
| FSDP2 | fp32 shard (4 P / n) | fp32 shard (4 P / n) | 8 P / n | bf16 shard (2 T / n) |

Gathered while in use (FSDP2 and ZeRO-3): the layers being computed (two at a time with prefetching) and, under FSDP2,
the root unit the trainer keeps whole through a step (embeddings, final norm, LM head: the chunked losses read the
head). Rollouts gather the whole student once (generation cannot run on shards); that peak is listed separately.

Activations: the student's packed forward keeps, per token and per layer, its bf16 inputs to the norms, attention and
MLP projections (`2 * (5 h + 2 q + 2 kv + 4 i)` bytes, h / q / kv / i the hidden, query, key-value and MLP widths),
with padding-free attention (no `width x width` scores); plus the chunked losses' fp32 tiles, about
`4 * logit_chunk_size * vocab * 4` bytes, whatever the number of action tokens. These are the same under every
strategy (each process packs its own rows). Allocator fragmentation, the CUDA context and communication buckets are
not counted.
"""

import argparse

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM


# Shapes of Qwen2.5-3B and Qwen2.5-7B (their published configs).
QWEN25_3B = dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)  # fmt: skip
QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)  # fmt: skip
GIB = 1024**3


def shape(config: dict) -> dict:
    """Parameter counts of the whole model, of its largest decoder layer and of the root (embeddings, norm, head)."""
    with torch.device("meta"):
        model = Qwen2ForCausalLM(Qwen2Config(**config))
    total = sum(p.numel() for p in model.parameters())  # tied weights counted once
    layer = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    root = total - sum(p.numel() for layer in model.model.layers for p in layer.parameters())
    return {"total": total, "layer": layer, "root": root}


def activations(config: dict, tokens: int, chunk: int) -> float:
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    head_dim = h // config["num_attention_heads"]
    q, kv = h, config["num_key_value_heads"] * head_dim
    per_token_layer = 2 * (5 * h + 2 * q + 2 * kv + 4 * i)
    return tokens * layers * per_token_layer + 4 * chunk * config["vocab_size"] * 4


def table(student: dict, teacher: dict, gpus: int, tokens: int, chunk: int) -> list[dict]:
    s, t = shape(student), shape(teacher)
    P, T, n = s["total"], t["total"], gpus
    act = activations(student, tokens, chunk)
    rows = {
        "DDP": dict(weights=4 * P, gradients=4 * P, optimizer=8 * P, teacher=2 * T, gathered=0, rollout=0),
        "ZeRO-2": dict(weights=2 * P + 4 * P / n, gradients=2 * P / n, optimizer=8 * P / n, teacher=2 * T,
                       gathered=0, rollout=0),  # fmt: skip
        "ZeRO-3": dict(weights=(2 + 4) * P / n, gradients=2 * P / n, optimizer=8 * P / n, teacher=2 * T / n,
                       gathered=2 * 2 * max(s["layer"], t["layer"]), rollout=2 * P),  # fmt: skip
        "FSDP2": dict(weights=4 * P / n, gradients=4 * P / n, optimizer=8 * P / n, teacher=2 * T / n,
                      gathered=2 * 2 * max(s["layer"], t["layer"]) + 2 * s["root"], rollout=2 * P),  # fmt: skip
    }
    out = []
    for name, row in rows.items():
        train = sum(row[k] for k in ("weights", "gradients", "optimizer", "teacher", "gathered")) + act
        out.append({"strategy": name, **row, "activations": act, "training": train, "rollout_peak": row["rollout"]})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--max_tokens_per_row", type=int, default=8192, help="tokens in the student's packed forward")
    parser.add_argument("--logit_chunk_size", type=int, default=256)
    args = parser.parse_args()
    s, t = shape(QWEN25_3B), shape(QWEN25_7B)
    print(f"student Qwen2.5-3B shape: {s['total'] / 1e9:.2f}B parameters; teacher Qwen2.5-7B shape: "
          f"{t['total'] / 1e9:.2f}B; {args.gpus} GPUs; {args.max_tokens_per_row} tokens per packed forward; "
          f"logit_chunk_size {args.logit_chunk_size}\n")  # fmt: skip
    columns = ["weights", "gradients", "optimizer", "teacher", "gathered", "activations", "training", "rollout_peak"]
    print("| strategy | " + " | ".join(columns) + " |")
    print("| --- |" + " ---: |" * len(columns))
    for row in table(QWEN25_3B, QWEN25_7B, args.gpus, args.max_tokens_per_row, args.logit_chunk_size):
        print(f"| {row['strategy']} | " + " | ".join(f"{row[c] / GIB:.1f}" for c in columns) + " |")
    print("\nGiB per GPU. `training`: the sum during the update; `rollout_peak`: the whole student gathered (bf16 "
          "under ZeRO-3, the FSDP2 unsharded dtype) on top of the sharded state while a rollout runs.")


if __name__ == "__main__":
    main()
