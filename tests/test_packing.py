"""Layout tests of the invocation collators (no model needed)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from memopd_trl.packing import (
    PackedInvocationCollator,
    PaddedInvocationCollator,
    first_fit_decreasing,
    gather_actions,
)
from memopd_trl.records import Invocation


def make_invocation(num_inputs: int, num_outputs: int, seed: int, **kwargs) -> Invocation:
    generator = torch.Generator().manual_seed(seed)
    return Invocation(
        input_ids=torch.randint(1, 500, (num_inputs,), generator=generator).tolist(),
        output_ids=torch.randint(1, 500, (num_outputs,), generator=generator).tolist(),
        **kwargs,
    )


@pytest.fixture
def invocations() -> list[Invocation]:
    sizes = [(12, 4), (5, 3), (20, 6), (7, 1), (3, 2), (9, 5)]
    return [make_invocation(a, b, seed=i, episode_id=i, turn=0) for i, (a, b) in enumerate(sizes)]


def _spans(batch: dict, index: int) -> list[tuple[int, int, int]]:
    """(row, first column, last column + 1) of every stretch of tokens of invocation `index`."""
    spans = []
    for r, row in enumerate(batch["invocation_index"].tolist()):
        cols = [c for c, i in enumerate(row) if i == index]
        if cols:
            spans.append((r, cols[0], cols[-1] + 1))
            assert cols == list(range(cols[0], cols[-1] + 1)), "tokens of one invocation are not contiguous"
    return spans


def test_each_invocation_is_rebuilt_whole_in_one_row_with_positions_from_zero(invocations):
    batch = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    for i, inv in enumerate(invocations):
        spans = _spans(batch, i)
        assert len(spans) == 1, f"invocation {i} split across rows: {spans}"
        r, start, end = spans[0]
        assert batch["input_ids"][r, start:end].tolist() == inv.input_ids + inv.output_ids
        assert batch["position_ids"][r, start:end].tolist() == list(range(inv.num_tokens))
        mask = (batch["action_target_index"][r, start:end] >= 0).tolist()
        assert mask == [False] * len(inv.input_ids) + [True] * len(inv.output_ids)


def test_action_mask_covers_exactly_the_output_tokens_in_canonical_order(invocations):
    batch = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    all_outputs = [t for inv in invocations for t in inv.output_ids]
    assert batch["num_action_tokens"] == len(all_outputs) == int((batch["action_target_index"] >= 0).sum())
    assert gather_actions(batch["input_ids"], batch["action_target_index"]).tolist() == all_outputs


def test_row_padding_restarts_positions_and_belongs_to_no_invocation(invocations):
    batch = PackedInvocationCollator(max_tokens_per_row=32, pad_token_id=7)(invocations)
    rows, width = batch["input_ids"].shape
    for r in range(rows):
        pad = (batch["invocation_index"][r] == -1).nonzero().view(-1).tolist()
        if not pad:
            continue
        assert pad == list(range(pad[0], width)), "padding must be at the end of the row"
        assert batch["position_ids"][r, pad[0] :].tolist() == list(range(len(pad)))
        assert set(batch["input_ids"][r, pad[0] :].tolist()) == {7}
        assert set(batch["action_target_index"][r, pad[0] :].tolist()) == {-1}


def test_packing_balances_the_rows_and_width_is_the_longest_row(invocations):
    # Lengths: 16, 8, 26, 8, 5, 14. First-fit decreasing into rows of 32 gives [[2, 4], [0, 5], [1, 3]] (width 31);
    # the same 3 rows balanced, longest first into the least loaded row: 26 | 16 + 8 | 14 + 8 + 5 (width 27).
    batch = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    rows = [list(dict.fromkeys(i for i in row if i >= 0)) for row in batch["invocation_index"].tolist()]
    assert rows == [[2], [0, 3], [5, 1, 4]]
    assert batch["input_ids"].shape == (3, 27)  # the longest row holds 14 + 8 + 5 tokens, not 32
    assert batch["num_real_tokens"] == sum(inv.num_tokens for inv in invocations) == 77
    assert batch["fill"] == pytest.approx(77 / (3 * 27))


def test_first_fit_decreasing_breaks_ties_by_input_order():
    assert first_fit_decreasing([4, 4, 4, 4], capacity=8) == [[0, 1], [2, 3]]
    assert first_fit_decreasing([3, 5, 3, 5], capacity=8) == [[1, 0], [3, 2]]


def test_packing_is_deterministic(invocations):
    collator = PackedInvocationCollator(max_tokens_per_row=32)
    first, second = collator(invocations), collator(list(invocations))
    for key in ("input_ids", "position_ids", "invocation_index", "action_target_index", "cu_seq_lens_q"):
        assert torch.equal(first[key], second[key]), key


def test_invocation_longer_than_a_row_gets_a_row_of_its_own():
    invocations = [make_invocation(40, 5, seed=0), make_invocation(3, 2, seed=1), make_invocation(4, 1, seed=2)]
    batch = PackedInvocationCollator(max_tokens_per_row=16)(invocations)
    assert batch["input_ids"].shape == (2, 45)
    assert set(batch["invocation_index"][0].tolist()) == {0}
    assert set(batch["invocation_index"][1].tolist()) == {1, 2, -1}


def test_invocation_longer_than_the_model_raises_naming_it():
    invocations = [make_invocation(5, 2, seed=0), make_invocation(30, 4, seed=1, episode_id=3, turn=2)]
    for collator in (PackedInvocationCollator(max_model_length=20), PaddedInvocationCollator(max_model_length=20)):
        with pytest.raises(ValueError, match=r"episode 3, turn 2.*34 tokens.*\(20\)"):
            collator(invocations)


def test_empty_input_raises():
    with pytest.raises(ValueError, match="empty list of invocations"):
        PackedInvocationCollator()([])
    with pytest.raises(ValueError, match="empty list of invocations"):
        PaddedInvocationCollator()([])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_tokens_per_row": 0}, "max_tokens_per_row"),
        ({"history": "flattened"}, "history"),
        ({"max_model_length": 0}, "max_model_length"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of"),
    ],
)
def test_bad_collator_settings_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PackedInvocationCollator(**kwargs)


def test_the_batch_describes_the_layout_only():
    # Per-token training data (sampled log-probs, advantages) stays with the trainer, in canonical order: the batch
    # only says where each action token sits, so it can be read back with `gather_actions`.
    invocations = [make_invocation(4, 3, seed=0, logprobs=[-0.1, -0.2, -0.3]), make_invocation(2, 2, seed=1)]
    packed = PackedInvocationCollator()(invocations)
    layout = {"input_ids", "position_ids", "invocation_index", "action_target_index", "num_invocations"}
    counts = {"num_action_tokens", "num_real_tokens", "num_tokens_saved", "fill"}
    varlen = {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
    assert set(packed) == layout | counts | varlen
    assert set(PaddedInvocationCollator()(invocations)) == layout | counts | {"attention_mask"}


def test_flash_varlen_boundaries_match_transformers_reading_of_the_flattened_positions(invocations):
    batch = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    (cu_q, cu_k), (max_q, _) = prepare_fa_kwargs_from_position_ids(batch["position_ids"].reshape(1, -1))
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and batch["cu_seq_lens_q"].dim() == 1
    assert torch.equal(batch["cu_seq_lens_q"], cu_q) and torch.equal(batch["cu_seq_lens_k"], cu_k)
    assert batch["max_length_q"] == batch["max_length_k"] == int(max_q) == 26
    assert isinstance(batch["max_length_q"], int)
    # 6 invocations + the padding of the rows that have some (width 27: rows hold 26, 24 and 27 tokens).
    assert batch["cu_seq_lens_q"].tolist() == [0, 26, 27, 43, 51, 54, 68, 76, 81]


def test_padded_collator_gives_one_invocation_per_row_with_an_attention_mask(invocations):
    batch = PaddedInvocationCollator(pad_token_id=9)(invocations)
    width = max(inv.num_tokens for inv in invocations)
    assert batch["input_ids"].shape == (len(invocations), width)
    assert "cu_seq_lens_q" not in batch
    for i, inv in enumerate(invocations):
        assert batch["input_ids"][i, : inv.num_tokens].tolist() == inv.input_ids + inv.output_ids
        assert set(batch["input_ids"][i, inv.num_tokens :].tolist()) <= {9}
        assert batch["attention_mask"][i].tolist() == [1] * inv.num_tokens + [0] * (width - inv.num_tokens)
        assert batch["position_ids"][i].tolist() == list(range(width))
    packed = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    assert torch.equal(
        gather_actions(batch["input_ids"], batch["action_target_index"]),
        gather_actions(packed["input_ids"], packed["action_target_index"]),
    )


def test_pad_to_multiple_of_rounds_the_width(invocations):
    batch = PackedInvocationCollator(max_tokens_per_row=32, pad_to_multiple_of=8)(invocations)
    assert batch["input_ids"].shape == (3, 32)


def _compact_episode(episode_id: int) -> list[Invocation]:
    """Three turns where each context is prompt + last action + new observation (a memory rewrite)."""
    prompt, obs = [1, 2, 3], [[10, 11], [20, 21, 22], [30]]
    actions = [[40, 41], [50], [60, 61, 62]]
    invocations = []
    for k in range(3):
        memory = actions[k - 1] if k else []
        invocations.append(
            Invocation(
                input_ids=prompt + memory + obs[k],
                output_ids=actions[k],
                episode_id=episode_id,
                turn=k,
                observation_ids=[99] + obs[k + 1] if k < 2 else None,
            )
        )
    return invocations


def test_persistent_history_flattens_each_episode_into_one_sequence():
    episode = _compact_episode(episode_id=5)
    batch = PackedInvocationCollator(history="persistent")(episode)
    expected = [1, 2, 3, 10, 11, 40, 41, 99, 20, 21, 22, 50, 99, 30, 60, 61, 62]
    assert batch["input_ids"].tolist() == [expected]
    assert batch["position_ids"].tolist() == [list(range(len(expected)))]
    assert batch["invocation_index"].tolist() == [[0] * 11 + [1] * 3 + [2] * 3]
    assert batch["action_target_index"].tolist() == [[-1, -1, -1, -1, -1, 0, 1, -1, -1, -1, -1, 2, -1, -1, 3, 4, 5]]


def test_persistent_history_keeps_canonical_order_for_shuffled_interleaved_episodes():
    a, b = _compact_episode(0), _compact_episode(1)
    invocations = [b[2], a[1], b[0], a[0], a[2], b[1]]  # arbitrary order and turns out of order
    aligned = PackedInvocationCollator()(invocations)
    for collator in (PackedInvocationCollator(history="persistent"), PaddedInvocationCollator(history="persistent")):
        persistent = collator(invocations)
        real = persistent["invocation_index"] >= 0
        assert int((persistent["position_ids"][real] == 0).sum()) == 2  # one flattened sequence per episode
        assert torch.equal(
            gather_actions(persistent["input_ids"], persistent["action_target_index"]),
            gather_actions(aligned["input_ids"], aligned["action_target_index"]),
        )


def test_persistent_history_without_observation_ids_raises_naming_the_turn():
    episode = _compact_episode(episode_id=4)
    episode[1].observation_ids = None
    with pytest.raises(ValueError, match=r"episode 4, turn 1.*observation_ids"):
        PackedInvocationCollator(history="persistent")(episode)


def test_persistent_history_with_repeated_turn_raises():
    episode = _compact_episode(episode_id=2)
    episode[2].turn = 1
    with pytest.raises(ValueError, match=r"Episode 2 .*same turn"):
        PackedInvocationCollator(history="persistent")(episode)


def test_persistent_history_longer_than_the_model_raises_naming_the_episode():
    with pytest.raises(ValueError, match=r"episode 6 .*17 tokens"):
        PackedInvocationCollator(history="persistent", max_model_length=16)(_compact_episode(6))


def test_gather_actions_rejects_an_index_that_is_not_a_numbering():
    values = torch.arange(6).view(2, 3)
    with pytest.raises(ValueError, match="0..N-1"):
        gather_actions(values, torch.tensor([[-1, 0, 0], [-1, -1, 1]]))  # 0 twice, 2 missing
    assert gather_actions(values, torch.tensor([[-1, 2, 0], [-1, 1, -1]])).tolist() == [2, 4, 1]


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 30), st.integers(0, 10)), min_size=1, max_size=12),
    row=st.integers(1, 60),
)
def test_any_packing_keeps_invocations_whole_and_the_canonical_order(sizes, row):
    invocations = [make_invocation(a, b, seed=i) for i, (a, b) in enumerate(sizes)]
    batch = PackedInvocationCollator(max_tokens_per_row=row)(invocations)
    longest = max(a + b for a, b in sizes)
    assert batch["input_ids"].shape[1] <= max(row, longest)
    for i, inv in enumerate(invocations):
        ((r, start, end),) = _spans(batch, i)
        assert batch["input_ids"][r, start:end].tolist() == inv.input_ids + inv.output_ids
        assert batch["position_ids"][r, start:end].tolist() == list(range(inv.num_tokens))
    outputs = [t for inv in invocations for t in inv.output_ids]
    assert gather_actions(batch["input_ids"], batch["action_target_index"]).tolist() == outputs
    assert int(batch["cu_seq_lens_q"][-1]) == batch["input_ids"].numel()
