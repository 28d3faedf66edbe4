"""Worked example: what a teacher asks the student to write when it reads the persistent history instead of the
student's own state.

Takes the main job's cached set-up (`--setup_dir`: its `teacher` and `student_init`), plays the student start greedily
on held-out two-part lookup tasks in the compact layout, and at every recorded model call lets the teacher write its
own greedy action twice: in the exact context the student was in (aligned), and after the episode's flattened history
up to that call (persistent). For each turn it reports how often each action holds the first and the second
sub-answer, and prints one turn-2 example. With a forgetful student, the first answer is gone from its compact state
by turn 2 but still in the history: a persistent teacher wants it written from a passage the student no longer sees.

    python benchmarks/persistent_targets.py --setup_dir outputs/hotpot [--tasks 50]
    python benchmarks/persistent_targets.py --setup_dir outputs/hotpot-smollm2 --num_train_questions 400 \
        --max_new_tokens 64 --max_prompt_length 768   # the SmolLM2 recipe's set-up

Run it with the world flags of the run that built the set-up (defaults: the main job's offline world).
"""

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl import RolloutEngine  # noqa: E402
from memopd_trl.envs.multi import MULTI_ANSWER_SEPARATOR  # noqa: E402
from offline_lab import OfflineConfig, load_offline_model, load_offline_tokenizer, make_offline_world  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup_dir", required=True, help="A main-job output directory with its cached set-up.")
    parser.add_argument("--tasks", type=int, default=50, help="Held-out tasks played.")
    parser.add_argument("--world_seed", type=int, default=0)
    parser.add_argument("--num_train_questions", type=int, default=6000, help="The run's (examples/smollm2.yaml: 400).")
    parser.add_argument("--num_eval_questions", type=int, default=200)
    parser.add_argument("--max_new_tokens", type=int, default=96)
    parser.add_argument("--max_prompt_length", type=int, default=512)
    return parser.parse_args()


def greedy_action(model, tokenizer, context: list[int], max_new_tokens: int) -> str:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([context]), attention_mask=torch.ones(1, len(context), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    text = tokenizer.decode(out[0, len(context) :], skip_special_tokens=True)
    return text.split("</search>")[0].split("</answer>")[0]


def main() -> None:
    args = parse_args()
    config = OfflineConfig(
        lookup_fraction=1.0, short_names=True, num_sub_questions=2, world_seed=args.world_seed,
        num_train_questions=args.num_train_questions, num_eval_questions=args.num_eval_questions,
    )  # fmt: skip  (the main job's offline world)
    world = make_offline_world(config, max_turns=4, memory_policy="compact", action_format="memopd")
    setup = Path(args.setup_dir)
    tokenizer = load_offline_tokenizer(setup / "teacher")
    teacher, student = load_offline_model(setup / "teacher").eval(), load_offline_model(setup / "student_init").eval()
    engine = RolloutEngine(
        student, tokenizer, world.env_factory, max_new_tokens=args.max_new_tokens,
        max_prompt_length=args.max_prompt_length,
    )  # fmt: skip
    records = world.evaluation[: args.tasks]
    episodes, _ = engine.rollout(records, num_generations=1, greedy=True)
    counts = defaultdict(lambda: defaultdict(int))  # turn -> what -> count
    example = None
    for record, episode in zip(records, episodes, strict=True):
        answers = record["answer"].split(MULTI_ANSWER_SEPARATOR)
        history = list(episode.invocations[0].input_ids)
        for inv in episode.invocations:
            if inv.turn > 0:
                aligned = greedy_action(teacher, tokenizer, inv.input_ids, args.max_new_tokens)
                persistent = greedy_action(teacher, tokenizer, history, args.max_new_tokens)
                row = counts[inv.turn]
                row["calls"] += 1
                for name, text in (("aligned", aligned), ("persistent", persistent)):
                    for k, answer in enumerate(answers):
                        row[f"{name}_answer_{k + 1}"] += answer.lower() in text.lower()
                if inv.turn == 2 and example is None:
                    example = (record["question"], answers, tokenizer.decode(inv.input_ids[-200:]), aligned, persistent)
                if inv.turn == 2:
                    for name, text in (("aligned", aligned), ("persistent", persistent)):
                        kind = "answer" if "<answer>" in text else "search" if "<search>" in text else "other"
                        row[f"{name}_{kind}"] += 1
            history += inv.output_ids + (inv.observation_ids or [])
    print(f"student start, greedy, {len(records)} held-out tasks: F1 {sum(e.f1 for e in episodes) / len(episodes):.3f}")
    for turn in sorted(counts):
        row = counts[turn]
        n = row["calls"]
        shares = " ".join(
            f"{name} {row[f'{name}_answer_1'] / n:.0%}/{row[f'{name}_answer_2'] / n:.0%}" for name in ("aligned", "persistent")
        )
        print(f"turn {turn} ({n} calls): teacher's action holds answer 1 / answer 2: {shares}")
        if turn == 2:
            kinds = {name: {k: row[f"{name}_{k}"] for k in ("answer", "search", "other")} for name in ("aligned", "persistent")}
            print(f"turn 2 actions: {kinds}")
    if example is not None:
        question, answers, context, aligned, persistent = example
        print(f"\nexample, turn 2: {question!r}, answers {answers}\n  the student's context ends: ...{context[-300:]!r}")
        print(f"  teacher, aligned:    {aligned!r}\n  teacher, persistent: {persistent!r}")


if __name__ == "__main__":
    main()
