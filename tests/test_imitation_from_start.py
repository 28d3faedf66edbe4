"""benchmarks/imitation_from_start.py (can the start learn the teacher's behaviour by imitation without breaking) on
the smoke preset."""

import json
from pathlib import Path

import pytest
import torch


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def imitation(import_benchmark):
    return import_benchmark("imitation_from_start")


def test_branch_masks_leave_out_only_each_episodes_first_unlikely_token(imitation, make_tiny_model, tiny_tokenizer):
    from memopd_trl.packing import PackedInvocationCollator
    from memopd_trl.records import Invocation

    model = make_tiny_model(seed=0).eval()
    ids = tiny_tokenizer("the violinist was born in zenim", add_special_tokens=False)["input_ids"]
    episode = [Invocation(input_ids=ids[:3], output_ids=ids[3:5]), Invocation(input_ids=ids[:4], output_ids=ids[4:])]
    collator = PackedInvocationCollator(max_tokens_per_row=64, pad_token_id=tiny_tokenizer.pad_token_id)
    tokens = len(ids[3:5]) + len(ids[4:])
    # Every token of an untrained model is below probability 0.9999: only the episode's first is its branch point.
    (always,) = imitation.branch_masks(model, [episode], collator, threshold=0.9999)
    assert always.tolist() == [False] + [True] * (tokens - 1)
    (never,) = imitation.branch_masks(model, [episode], collator, threshold=1e-30)
    assert never.tolist() == [True] * tokens
    with torch.no_grad():
        logprobs = imitation.action_logprobs(model, collator(episode))
    middle = float(logprobs.exp().sort().values[tokens // 2])  # half the tokens are less likely than this
    (mask,) = imitation.branch_masks(model, [episode], collator, threshold=middle)
    first = next(i for i, lp in enumerate(logprobs.tolist()) if lp < torch.tensor(middle).log().item())
    assert (~mask).nonzero().flatten().tolist() == [first]


def test_the_curve_holds_then_releases(imitation, tmp_path):
    report = imitation.main(["--config", str(ROOT / "examples" / "smoke.yaml"), "--output_dir", str(tmp_path),
                             "--hold_updates", "2", "--release_updates", "1", "--every", "1", "--episodes", "2",
                             "--num_tasks", "2"])  # fmt: skip
    assert [update for update, _ in report["curve"]] == [0, 1, 2, 3] and len(report["expert_nll"]) == 3
    saved = json.loads((tmp_path / "imitation-lr0.003-anchor1-hold2-release1.json").read_text())
    assert saved["curve"] == [list(point) for point in report["curve"]]
