"""Benchmark: the project's own code against transformers' where both do the same thing (docs/benchmarks.md, "Own
code or transformers'").

**Stop strings**: the rollout's `_StopOnText` against `GenerationConfig(stop_strings=...)` (transformers'
`StopStringCriteria`, with `tokenizer=` passed to `generate`), on the offline lab's byte-level tokenizers:

- *same step*: each criterion driven token by token over fixed generated sequences after a ChatML prompt (a tag that
  is one token, a tag split across tokens, stop strings that end inside a token, a multi-byte character, a stop string
  that begins in the prompt); the step at which it ends the row, next to the engine's cut (`find_stop`);
- *one generate call's criterion*: building the criterion and calling it at every step of a batch of random tokens,
  no model, with the 512-token tokenizer of the tests and one of `--large_vocab` tokens (a real model's size);
- *rollouts*: whole `RolloutEngine.rollout` calls of random tiny Qwen2 models with each criterion, and whether both
  played the same tokens.

**Tree mask**: `attention.tree_attention_mask` against the same mask built by transformers' `sdpa_mask` / `eager_mask`
from `and_masks(causal_mask_function, or_masks(packed_sequence_mask_function(...), <in the continued prefix>))`, on
the synthetic memory-agent invocations of benchmarks/shared_prefix.py packed with shared prefixes in rows of 1024 and
4096 tokens, split into rows as the trainer forwards them: whether the masks are equal, the time to build them, and
the teacher's forward (`sdpa`, no grad, the main job's width) with each.

**flex_attention** (`--part flex`, on its own: it compiles): the tests' shared-prefix batches scored under
`flex_attention` with a block mask from the same mask function, against each invocation scored alone.

Every time is a median of `--repeats` interleaved repeats.

    python benchmarks/own_or_transformers.py
    python benchmarks/own_or_transformers.py --part flex
"""

import argparse
import os
import platform
import random
import string
import sys
import time
from pathlib import Path
from unittest import mock

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers import StoppingCriteria
from transformers.generation.stopping_criteria import StopStringCriteria
from transformers.masking_utils import eager_mask, sdpa_mask


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from rollout_prefill import interleaved  # noqa: E402
from shared_prefix import synthetic_invocations  # noqa: E402

from memopd_trl import HotpotQAEnv, RolloutEngine, rollout, scoring  # noqa: E402
from memopd_trl.attention import tree_attention_mask  # noqa: E402
from memopd_trl.packing import PackedInvocationCollator, split_rows  # noqa: E402
from memopd_trl.rollout import _StopOnText, find_stop  # noqa: E402
from offline_lab import build_tiny_model, build_tokenizer, make_synthetic_world  # noqa: E402


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import TOKENIZER_TEXTS  # noqa: E402
from test_shared_prefix import model, question_invocations, shared, transformers_tree_mask_function  # noqa: E402


STOPS = ("</search>", "</answer>")
NEW_TOKENS = 64  # most tokens per action: in the criterion-only batch and in the rollouts
CRITERION_ROWS, PROMPT_WIDTH = 32, 300  # the criterion-only batch: rows of random tokens after a prompt this wide
NUM_GENERATIONS, MAX_TURNS = 4, 2  # rollouts: episodes per question, turns per episode
# The tree-mask part: synthetic questions of benchmarks/shared_prefix.py, their vocabulary; the main job's teacher.
MASK_QUESTIONS, MASK_VOCAB, TEACHER_HIDDEN, TEACHER_LAYERS = 4, 1000, 128, 2


class _GenerationConfigStops(RolloutEngine):
    """The engine with `GenerationConfig(stop_strings=STOPS)`: `generate` builds transformers' criterion from it."""

    def _generation_config(self, greedy: bool):
        config = super()._generation_config(greedy)
        config.stop_strings = list(STOPS)
        return config


class _NoStop(StoppingCriteria):
    """Stands in for `_StopOnText` when transformers' criterion does the stopping."""

    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def first_stop_step(criterion, prompt: list[int], generated: list[int]) -> int | None:
    """The number of generated tokens after which `criterion` first ends the (single) row."""
    for step in range(1, len(generated) + 1):
        if bool(criterion(torch.tensor([prompt + generated[:step]]), None)[0]):
            return step
    return None


def same_step_cases(tokenizer) -> list[str]:
    chat = [{"role": "user", "content": "Which city?"}]
    prompt_text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]

    def encode(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def tokens(*names):
        return [tokenizer.convert_tokens_to_ids(name) for name in names]

    cases = [
        ("tag is one token", encode("<memory>m</memory><search>paris</search> more"), STOPS),
        ("tag split across tokens", encode("abc") + tokens("<", "/", "search", ">", "<"), STOPS),
        ("split, ends inside `>..`", encode("q") + tokens("<", "/", "search", ">..", "a"), STOPS),
        ("ends inside ` Paris`", encode("x Paris y"), (" Pa",)),
        ("ends inside ` capital`", encode("the capital of France."), ("capit",)),
        ("multi-byte, byte tokens", encode("a → b"), ("→",)),
        ("stop string begins in the prompt", encode("Obs: x"), ("\nObs:",)),
    ]
    lines = [
        "| case | generated tokens | `_StopOnText` | `StopStringCriteria` | engine's cut (`find_stop`) |",
        "|---|---|---|---|---|",
    ]
    for name, generated, stops in cases:
        ours = first_stop_step(_StopOnText(tokenizer, [stops], len(prompt)), prompt, generated)
        theirs = first_stop_step(StopStringCriteria(tokenizer, list(stops)), prompt, generated)
        shown = " ".join(f"`{t}`" for t in tokenizer.convert_ids_to_tokens(generated))
        cut = find_stop(tokenizer, generated, stops)
        lines.append(f"| {name}: {', '.join(f'`{s!r}`' for s in stops)} | {shown} | {ours} | {theirs} | {cut} |")
    return lines


def criterion_cost(tokenizer, args) -> dict[str, float]:
    """Median seconds of building each criterion and calling it at every step of one batch, no model."""
    generator = torch.Generator().manual_seed(0)
    ordinary = torch.tensor([t for t in range(len(tokenizer)) if t not in set(tokenizer.all_special_ids)])
    batch = ordinary[torch.randint(0, len(ordinary), (CRITERION_ROWS, PROMPT_WIDTH + NEW_TOKENS), generator=generator)]
    stops = [STOPS] * CRITERION_ROWS

    def run(make):
        criterion = make()
        for step in range(1, NEW_TOKENS + 1):
            criterion(batch[:, : PROMPT_WIDTH + step], None)

    return interleaved(
        {
            "_StopOnText": lambda: run(lambda: _StopOnText(tokenizer, stops, PROMPT_WIDTH)),
            "StopStringCriteria": lambda: run(lambda: StopStringCriteria(tokenizer, list(STOPS))),
        },
        args.repeats,
    )


def rollouts(tokenizer, hidden: int, layers: int, args) -> dict:
    """Whole rollouts of a random Qwen2 with each criterion; whether both played the same tokens."""
    world = make_synthetic_world(args.questions, seed=0)
    model = build_tiny_model(
        len(tokenizer),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(2, hidden // 64),
        num_key_value_heads=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    ).eval()
    env_factory = HotpotQAEnv.factory(corpus=world.corpus, top_k=1, max_turns=MAX_TURNS, system_prompt="Act.")
    settings = dict(max_new_tokens=NEW_TOKENS, temperature=1.0)
    ours = RolloutEngine(model, tokenizer, env_factory, **settings)
    theirs = _GenerationConfigStops(
        model, tokenizer, env_factory, generation_kwargs={"tokenizer": tokenizer}, **settings
    )
    played, stats = {}, {}

    def play(name, engine):
        episodes, stats[name] = engine.rollout(world.records, num_generations=NUM_GENERATIONS)
        played[name] = [[inv.output_ids for inv in episode.invocations] for episode in episodes]

    def play_theirs():
        with mock.patch.object(rollout, "_StopOnText", lambda *_: _NoStop()):
            play("StopStringCriteria", theirs)

    times = interleaved({"_StopOnText": lambda: play("_StopOnText", ours), "StopStringCriteria": play_theirs},
                        args.repeats)  # fmt: skip
    return {
        "setting": f"random Qwen2 hidden {hidden}, {layers} layer(s): {args.questions} questions x "
        f"{NUM_GENERATIONS} episodes, up to {MAX_TURNS} turns, {NEW_TOKENS} new tokens",
        "times": times,
        "invocations": stats["_StopOnText"]["num_turns"],
        "tokens": stats["_StopOnText"]["num_generated_tokens"],
        "same": played["_StopOnText"] == played["StopStringCriteria"],
    }


def timing_rows(name_of_time: str, times: dict[str, float], scale: float = 1.0) -> list[str]:
    base = times["_StopOnText"]
    return [
        f"| criterion | {name_of_time} | ratio to `_StopOnText` |",
        "|---|---|---|",
        *(f"| `{name}` | {value * scale:.3f} | {value / base:.2f}x |" for name, value in times.items()),
        "",
    ]


def large_tokenizer(vocab_size: int):
    """A lab tokenizer of a real model's vocabulary size, trained on the synthetic world and random words."""
    generator = random.Random(0)
    words = ["".join(generator.choices(string.ascii_lowercase, k=generator.randint(3, 9))) for _ in range(200_000)]
    lines = [" ".join(words[i : i + 50]) for i in range(0, len(words), 10)]
    return build_tokenizer(make_synthetic_world(1000, seed=0).texts() + lines, vocab_size=vocab_size, min_frequency=1)


def transformers_tree_mask(batch: dict, dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """The tree mask as transformers builds it from the composed mask function (`sdpa_mask`, or `eager_mask`)."""
    rows, width = batch["input_ids"].shape
    mask_function = transformers_tree_mask_function(batch)
    if dtype == torch.bool:
        return sdpa_mask(rows, width, width, mask_function=mask_function, allow_is_causal_skip=False)
    return eager_mask(rows, width, width, mask_function=mask_function, dtype=dtype)


MASKS = {"tree_attention_mask": tree_attention_mask, "transformers' mask functions": transformers_tree_mask}


def mask_times(rows: list[dict], teacher, repeats: int) -> dict[str, dict[str, float]]:
    """Median seconds of building every row's mask (bool, fp32) and of the teacher's forward over the rows."""

    def build(mask, dtype):
        return lambda: [mask(row, dtype) for row in rows]

    def forward(mask):
        def run():
            with torch.no_grad(), mock.patch.object(scoring, "tree_attention_mask", mask):
                for row in rows:
                    scoring.action_logprobs(teacher, row)

        return run

    return {
        "bool": interleaved({name: build(mask, torch.bool) for name, mask in MASKS.items()}, repeats),
        "fp32": interleaved({name: build(mask, torch.float32) for name, mask in MASKS.items()}, repeats),
        "forward": interleaved({name: forward(mask) for name, mask in MASKS.items()}, repeats),
    }


def tree_mask_lines(args) -> list[str]:
    invocations = synthetic_invocations(argparse.Namespace(synthetic_questions=MASK_QUESTIONS), MASK_VOCAB)
    teacher = build_tiny_model(MASK_VOCAB, hidden_size=TEACHER_HIDDEN, num_hidden_layers=TEACHER_LAYERS,
                               num_attention_heads=2, num_key_value_heads=2).eval()  # fmt: skip
    lines = [
        f"**Tree mask.** {len(invocations)} invocations ({MASK_QUESTIONS} synthetic questions), shared-prefix "
        f"packing split into the trainer's rows; teacher: Qwen2 hidden {TEACHER_HIDDEN}, {TEACHER_LAYERS} layers, "
        "`sdpa`, no grad. Ratios to `tree_attention_mask` in brackets.",
        "",
        "| rows of | rows x width | mask | same mask (bool, fp32, bf16) | build, bool (ms) | build, fp32 (ms) | "
        "teacher forward (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row_tokens in (1024, 4096):
        batch = PackedInvocationCollator(max_tokens_per_row=row_tokens, share_prefix=True)(invocations)
        rows = split_rows(batch, num_rows=batch["input_ids"].shape[0])
        same = all(
            torch.equal(tree_attention_mask(row, dtype), transformers_tree_mask(row, dtype))
            for row in rows
            for dtype in (torch.bool, torch.float32, torch.bfloat16)
        )
        times = mask_times(rows, teacher, args.repeats)
        for name in MASKS:
            cells = []
            for what, scale, digits in (("bool", 1e3, 1), ("fp32", 1e3, 1), ("forward", 1, 3)):
                ratio = times[what][name] / times[what]["tree_attention_mask"]
                cells.append(f"{times[what][name] * scale:.{digits}f} ({ratio:.2f}x)")
            shape = f"{len(rows)} x {batch['input_ids'].shape[1]}"
            lines.append(f"| {row_tokens} | {shape} | `{name}` | {'yes' if same else 'NO'} | {' | '.join(cells)} |")
    return lines


def flex_block_mask(batch: dict, dtype: torch.dtype | None = None):
    """The tree as a flex-attention block mask, from the same mask function (`dtype` is not used)."""
    rows, width = batch["input_ids"].shape
    mask_function = transformers_tree_mask_function(batch)
    return create_block_mask(mask_function, B=rows, H=None, Q_LEN=width, KV_LEN=width, device="cpu")


def flex_lines() -> list[str]:
    """Score the tests' shared-prefix batches under `flex_attention`, each against every invocation scored alone."""
    invocations = question_invocations()
    with torch.no_grad():
        alone = scoring.full_logits_action_logprobs(model("qwen2", "sdpa"), invocations)
    flex = model("qwen2", "flex_attention")
    lines = [
        "**flex_attention** (the tests' invocations and tiny Qwen2; a block mask from the same mask function; no "
        "grad; in this order, in one process):",
        "",
        "| layout | rows x width | max abs. difference to each invocation alone | time (s) |",
        "|---|---|---|---|",
    ]
    for name, row_tokens in (("one row", None), ("rows of 256", 256), ("rows of 64", 64)):
        batch = shared(invocations, max_tokens_per_row=row_tokens)
        shape = " x ".join(map(str, batch["input_ids"].shape))
        start = time.perf_counter()
        try:
            with (
                torch.no_grad(),
                mock.patch.object(scoring, "TREE_ATTENTION_IMPLEMENTATIONS", ("flex_attention",)),
                mock.patch.object(scoring, "tree_attention_mask", flex_block_mask),
            ):
                difference = f"{(scoring.action_logprobs(flex, batch) - alone).abs().max():.1e}"
        except Exception as error:  # report what fails, and go on
            difference = f"{type(error).__name__}: {str(error).splitlines()[0][:80]}"
        lines.append(f"| {name} | {shape} | {difference} | {time.perf_counter() - start:.1f} |")
    return lines


def stop_string_lines(args) -> list[str]:
    tokenizers = [build_tokenizer(TOKENIZER_TEXTS, vocab_size=512)]
    if args.large_vocab:
        tokenizers.append(large_tokenizer(args.large_vocab))
    lines = [
        f"**Same step** ({len(tokenizers[0])}-token tokenizer). The number of generated tokens after which each "
        "criterion ends the row:",
        "",
        *same_step_cases(tokenizers[0]),
        "",
    ]
    for tokenizer in tokenizers:
        lines += [
            f"**One generate call's criterion, {len(tokenizer)}-token tokenizer** (built, then called at each of "
            f"{NEW_TOKENS} steps over {CRITERION_ROWS} rows of random tokens after {PROMPT_WIDTH} prompt tokens; no "
            "model):",
            "",
            *timing_rows("ms per call", criterion_cost(tokenizer, args), scale=1e3),
        ]
    for hidden, layers in ((32, 1), (256, 4)):
        result = rollouts(tokenizers[0], hidden, layers, args)
        lines += [
            f"**Rollouts, {len(tokenizers[0])}-token tokenizer, {result['setting']}** ({result['invocations']} "
            f"invocations, {result['tokens']} sampled tokens; same tokens with both: "
            f"{'yes' if result['same'] else 'NO'}):",
            "",
            *timing_rows("seconds", result["times"]),
        ]
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", "stops", "mask", "flex"), default="all",
                        help="What to measure (`all`: stops and mask; `flex` compiles, on its own).")  # fmt: skip
    parser.add_argument("--questions", type=int, default=8, help="Questions of the rollouts.")
    parser.add_argument("--large_vocab", type=int, default=150_000, help="Size of the large tokenizer (0: skip).")
    parser.add_argument("--repeats", type=int, default=7, help="Interleaved repeats (medians are reported).")
    parser.add_argument("--threads", type=int, default=1, help="torch threads.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    lines = [
        f"Command: `python benchmarks/own_or_transformers.py {' '.join(sys.argv[1:])}`. Machine: {os.cpu_count()} "
        f"CPU cores ({platform.machine()}), {args.threads} torch thread(s), torch {torch.__version__}, fp32, medians "
        f"of {args.repeats} interleaved repeats.",
        "",
    ]
    if args.part in ("all", "stops"):
        lines += stop_string_lines(args)
    if args.part in ("all", "mask"):
        lines += tree_mask_lines(args)
    if args.part == "flex":
        lines += flex_lines()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
