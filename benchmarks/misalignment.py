"""Worked example: how far persistent-history scoring is from the state the student sampled in.

Plays a few scripted-expert episodes of the synthetic world with the **compact** memory policy, records every turn as
an `Invocation` (the context token ids the agent was conditioned on, the action token ids, and the `observation_ids`
that join a turn to the next one in a flattened history, derived from the chat template as `RolloutEngine` derives
them), then scores the actions with a small teacher three ways:

- **alone**: each invocation scored on its own with a plain full-logits forward (the reference);
- **aligned**: `PackedInvocationCollator(history="aligned")`, every invocation rebuilt with positions `0..len-1` and
  packed into rows (what MemOPD does);
- **persistent**: `PackedInvocationCollator(history="persistent")`, each episode flattened into one growing history
  (the matched control).

It prints, per turn, the context the student saw, the length of the persistent prefix the teacher sees instead, and
the mean / max absolute difference of the action log-probs. The teacher has random weights by default (enough to show
the mechanics); `--imitation-epochs E` first trains it briefly on expert turns of *other* questions so that it reads
its context like an agent does.

Run `python benchmarks/misalignment.py --help` for the options. The numbers in docs/concepts.md come from
`python benchmarks/misalignment.py` (defaults) and `python benchmarks/misalignment.py --imitation-epochs 5`.
"""

import argparse
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.envs.base import FullHistoryMemoryPolicy  # noqa: E402
from memopd_trl.envs.hotpot import HotpotQAEnv  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator  # noqa: E402
from memopd_trl.records import Invocation  # noqa: E402
from memopd_trl.scoring import action_logprobs, full_logits_action_logprobs  # noqa: E402
from offline_lab import (  # noqa: E402
    SyntheticExpert,
    build_tiny_model,
    build_tokenizer,
    expert_invocations,
    imitation_train,
    make_synthetic_world,
    play_episode,
)


# Assistant content that no template renders by itself; the text after it is what follows an action.
_SENTINEL = "[[misalignment-example-sentinel]]"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-questions", type=int, default=48, help="Questions in the synthetic world.")
    parser.add_argument("--num-episodes", type=int, default=2, help="Expert episodes scored (the first questions).")
    parser.add_argument("--world-seed", type=int, default=0, help="Seed of the synthetic world.")
    parser.add_argument("--model-seed", type=int, default=0, help="Seed of the teacher's weight initialisation.")
    parser.add_argument("--vocab-size", type=int, default=1024, help="Target vocabulary size of the local tokenizer.")
    parser.add_argument("--hidden-size", type=int, default=64, help="Teacher hidden size.")
    parser.add_argument("--num-layers", type=int, default=2, help="Teacher layers.")
    parser.add_argument(
        "--attn-implementation",
        default="sdpa",
        choices=["sdpa", "eager", "memopd_sdpa_varlen"],
        help="Attention implementation of the teacher for the packed forwards.",
    )
    parser.add_argument(
        "--imitation-epochs",
        type=float,
        default=0.0,
        help="Epochs of imitation training on the other questions' expert turns before scoring (0: random weights).",
    )
    parser.add_argument("--max-tokens-per-row", type=int, default=4096, help="Row budget of the packing collator.")
    return parser.parse_args(argv)


def observation_ids(tokenizer, output_ids: list[int], observation: str, eos_ids: set[int]) -> list[int]:
    """
    Token ids that follow an action in a flattened history (end of the assistant turn, the observation as a user
    message, the next generation prompt), rendered by the chat template: the rule `RolloutEngine` records.
    """
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": _SENTINEL},
        {"role": "user", "content": observation},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text.split(_SENTINEL, 1)[1], add_special_tokens=False)["input_ids"]
    if output_ids and ids and output_ids[-1] == ids[0] and ids[0] in eos_ids:
        ids = ids[1:]
    return ids


def record_episode(env, record: dict, tokenizer, episode_id: int, eos_ids: set[int]) -> list[Invocation]:
    """Play the expert on `record` and record every turn as an `Invocation` of episode `episode_id`."""
    expert_episode = play_episode(env, record, SyntheticExpert(env.action_format))
    invocations = expert_invocations(expert_episode.steps, tokenizer)  # one per turn, contexts as the engine renders
    steps = zip(invocations, env.turns, expert_episode.steps, strict=True)
    for turn, (inv, played, (messages, _)) in enumerate(steps):
        # The context exactly as `RolloutEngine` renders it: the chat template's text, tokenized without extra tokens.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if inv.input_ids != tokenizer(text, add_special_tokens=False)["input_ids"]:
            raise RuntimeError(f"Episode {episode_id}, turn {turn}: context tokens differ from the rollout engine's.")
        inv.episode_id, inv.turn = episode_id, turn
        if turn < len(invocations) - 1:
            inv.observation_ids = observation_ids(tokenizer, inv.output_ids, played.observation, eos_ids)
    # Check: the flattened history of turns 0..k-1 is token for token the context a persistent-policy agent gets.
    history = list(invocations[0].input_ids)
    policy = FullHistoryMemoryPolicy()
    for turn in range(1, len(invocations)):
        previous = invocations[turn - 1]
        history += previous.output_ids + previous.observation_ids
        messages = policy.build_messages(env.system_prompt, env.task, env.turns[:turn])
        expected = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if history != list(expected):
            raise RuntimeError(
                f"Episode {episode_id}, turn {turn}: the flattened history is not the persistent-policy context."
            )
    return invocations


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    torch.manual_seed(0)
    world = make_synthetic_world(args.num_questions, seed=args.world_seed)
    tokenizer = build_tokenizer(world.texts(), vocab_size=args.vocab_size)
    eos_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    env = HotpotQAEnv.factory(corpus=world.corpus, memory_policy="compact")()
    teacher = build_tiny_model(
        len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        attn_implementation=args.attn_implementation,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        seed=args.model_seed,
    )

    scored_records = world.records[: args.num_episodes]
    state = "random weights"
    if args.imitation_epochs > 0:
        train_steps = []
        for record in world.records[args.num_episodes :]:
            train_steps += play_episode(env, record, SyntheticExpert(env.action_format)).steps
        train_invocations = expert_invocations(train_steps, tokenizer)
        losses = imitation_train(
            teacher,
            train_invocations,
            epochs=args.imitation_epochs,
            learning_rate=3e-3,
            tokens_per_batch=4096,
            max_tokens_per_row=4096,
            pad_token_id=tokenizer.pad_token_id,
            progress=False,
        )
        state = (
            f"after {len(losses)} imitation steps ({args.imitation_epochs:g} epochs over {len(train_invocations)} "
            f"expert turns of {args.num_questions - args.num_episodes} other questions; action NLL "
            f"{losses[0]:.2f} -> {losses[-1]:.2f})"
        )

    invocations = []
    for episode_id, record in enumerate(scored_records):
        invocations += record_episode(env, record, tokenizer, episode_id, eos_ids)

    teacher.eval()
    aligned_collator = PackedInvocationCollator(args.max_tokens_per_row, tokenizer.pad_token_id, history="aligned")
    persistent_collator = PackedInvocationCollator(
        args.max_tokens_per_row, tokenizer.pad_token_id, history="persistent"
    )
    with torch.no_grad():
        alone = full_logits_action_logprobs(teacher, invocations)  # (N,) each invocation alone, full logits
        aligned = action_logprobs(teacher, aligned_collator(invocations))  # (N,) canonical action order
        persistent = action_logprobs(teacher, persistent_collator(invocations))  # (N,) same order

    print(
        f"teacher: qwen2, hidden {args.hidden_size}, {args.num_layers} layers, vocab {len(tokenizer)}, "
        f"seed {args.model_seed}, {args.attn_implementation}, {state}"
    )
    print(f"world: {args.num_questions} questions, seed {args.world_seed}; compact memory policy; scripted expert")
    print()
    print(
        "| episode | turn | action | context tokens (aligned) | persistent prefix tokens | action tokens "
        "| mean log-prob (aligned) | max abs(aligned - alone) | mean abs(persistent - aligned) "
        "| max abs(persistent - aligned) |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    offset, prefix = 0, {}
    for inv in invocations:
        n = len(inv.output_ids)
        span = slice(offset, offset + n)
        offset += n
        previous = prefix.get(inv.episode_id)
        prefix_length = len(inv.input_ids) if previous is None else previous
        prefix[inv.episode_id] = prefix_length + n + len(inv.observation_ids or [])
        gap = (persistent[span] - aligned[span]).abs()
        exact = (aligned[span] - alone[span]).abs().max().item()
        action = tokenizer.decode(inv.output_ids)
        kind = "search" if "<search>" in action else "answer"
        print(
            f"| {inv.episode_id} | {inv.turn} | {kind} | {len(inv.input_ids)} | {prefix_length} | {n} "
            f"| {aligned[span].mean().item():.3f} | {exact:.1e} "
            f"| {gap.mean().item():.4f} | {gap.max().item():.4f} |"
        )
    print()
    for episode_id, record in enumerate(scored_records):
        print(f"episode {episode_id}: {record['question']} (gold answer: {record['answer']})")
        for inv in invocations:
            if inv.episode_id == episode_id:
                print(f"  turn {inv.turn}: {tokenizer.decode(inv.output_ids)}")
    print()
    print(f"elapsed (after imports): {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
