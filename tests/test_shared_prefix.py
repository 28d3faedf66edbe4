"""Shared-prefix packing: invocations that begin with the same tokens scored as one tree, exactly (fp32, CPU)."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import (
    and_masks,
    causal_mask_function,
    eager_mask,
    or_masks,
    packed_sequence_mask_function,
    sdpa_mask,
)

from memopd_trl import attention, scoring
from memopd_trl.attention import TREE_ATTENTION_IMPLEMENTATIONS, VARLEN_SDPA, tree_attention_mask
from memopd_trl.packing import (
    PackedInvocationCollator,
    PaddedInvocationCollator,
    balanced_rows,
    first_fit_decreasing,
    gather_actions,
    split_rows,
)
from memopd_trl.records import Invocation
from memopd_trl.scoring import action_log_distributions, action_logprobs, full_logits_action_logprobs
from tiny_models import tiny_causal_lm


VOCAB = 256
ATOL = 1e-5


def ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=generator).tolist()


def question_invocations(num_questions=3, generations=4, turns=3, seed=0) -> list[Invocation]:
    """
    Memory-agent-shaped invocations: every question's calls begin with a preamble common to all questions and the
    question itself; turn 0 of every generation has the same input; later turns add a memory and an observation.
    """
    generator = torch.Generator().manual_seed(seed)
    preamble = ids(10, generator)
    invocations, episode = [], 0
    for _ in range(num_questions):
        prompt = preamble + ids(12, generator)
        for _ in range(generations):
            for turn in range(turns):
                context = prompt if turn == 0 else prompt + ids(int(torch.randint(3, 9, (1,), generator=generator)), generator)
                outputs = ids(int(torch.randint(1, 6, (1,), generator=generator)), generator)
                invocations.append(
                    Invocation(context, outputs, episode_id=episode, turn=turn, observation_ids=ids(4, generator))
                )
            episode += 1
    return invocations


@pytest.fixture(scope="module")
def invocations() -> list[Invocation]:
    return question_invocations()


def shared(invocations, **kwargs) -> dict:
    return PackedInvocationCollator(**{"max_tokens_per_row": 256, "share_prefix": True, **kwargs})(invocations)


def plain(invocations, **kwargs) -> dict:
    return PackedInvocationCollator(**{"max_tokens_per_row": 256, **kwargs})(invocations)


def model(architecture="qwen2", attn_implementation="sdpa", seed=0):
    return tiny_causal_lm(VOCAB, architecture=architecture, attn_implementation=attn_implementation, seed=seed)


# ----- layout -----------------------------------------------------------------------------------------------------


def test_each_question_is_one_tree_whose_prefix_appears_once(invocations):
    batch = shared(invocations)
    # 3 questions of 12 calls. A turn-0 input is the 22-token prompt, whose last token predicts the first action, so
    # each tree shares 21 tokens (the 10-token preamble common to all questions does not swallow the trees).
    assert batch["num_tokens_saved"] == 3 * 11 * 21
    assert batch["num_real_tokens"] + batch["num_tokens_saved"] == sum(inv.num_tokens for inv in invocations)
    assert "cu_seq_lens_q" not in batch  # the flat varlen fields cannot describe a tree
    flat_positions = batch["position_ids"].reshape(-1)
    starts = batch["tree_cu_seq_lens_q"][:-1].long()
    # Every remainder continues its prefix's positions: it starts at position 21, right after the prefix.
    assert sorted(set(flat_positions[starts].tolist())) == [0, 21]
    assert int((flat_positions[starts] == 21).sum()) == len(invocations)
    # The canonical action order is unchanged: the action tokens read back are every output, in input order.
    outputs = [t for inv in invocations for t in inv.output_ids]
    assert gather_actions(batch["input_ids"], batch["action_target_index"]).tolist() == outputs


def test_prefixes_come_from_token_ids_stop_before_the_first_action_and_respect_the_threshold():
    same = [Invocation([5, 6, 7, 8], [9]), Invocation([5, 6, 7, 8], [10, 11])]
    batch = PackedInvocationCollator(share_prefix=True, min_shared_prefix_length=2)(same)
    # Identical inputs share all but their last input token, which predicts each one's first action.
    assert batch["num_tokens_saved"] == 3
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 4, 5]]
    short = PackedInvocationCollator(share_prefix=True, min_shared_prefix_length=4)(same)
    assert short["num_tokens_saved"] == 0 and "tree_key_index" not in short
    assert torch.equal(short["input_ids"], PackedInvocationCollator()(same)["input_ids"])


def test_a_tree_that_outgrows_a_row_is_split_with_its_prefix_repeated(invocations):
    batch = shared(invocations, max_tokens_per_row=64)
    assert batch["input_ids"].shape[1] <= 64
    assert 0 < batch["num_tokens_saved"] < 3 * 11 * 21
    assert batch["num_real_tokens"] + batch["num_tokens_saved"] == sum(inv.num_tokens for inv in invocations)


@pytest.mark.parametrize("share_prefix", [False, True], ids=["plain", "shared"])
def test_no_row_budget_lays_out_one_row_without_padding_and_scores_exactly(invocations, share_prefix):
    # `max_tokens_per_row=None`: everything in one row (TRL's padding-free layout), no tree split; scores unchanged.
    one_row = PackedInvocationCollator(max_tokens_per_row=None, share_prefix=share_prefix)(invocations)
    rows = PackedInvocationCollator(max_tokens_per_row=64, share_prefix=share_prefix)(invocations)
    assert one_row["input_ids"].shape == (1, one_row["num_real_tokens"]) and one_row["fill"] == 1.0
    assert rows["input_ids"].shape[0] > 1
    if share_prefix:
        assert one_row["num_tokens_saved"] == 3 * 11 * 21 > rows["num_tokens_saved"]
    m = model("qwen2", VARLEN_SDPA)
    with torch.no_grad():
        alone = full_logits_action_logprobs(m, invocations)
        torch.testing.assert_close(action_logprobs(m, one_row), alone, atol=ATOL, rtol=0)
        torch.testing.assert_close(action_logprobs(m, rows), alone, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn_implementation", [VARLEN_SDPA, "sdpa", "eager"])
@pytest.mark.parametrize("share_prefix", [False, True], ids=["plain", "shared"])
def test_rows_scored_one_at_a_time_give_each_invocation_alone(invocations, share_prefix, attn_implementation):
    # The trainer forwards each row of a batch on its own (bounded activations): every row, cut at its last real
    # token, scores its actions as they score alone, and `action_index` puts them back in canonical order.
    batch = PackedInvocationCollator(max_tokens_per_row=64, share_prefix=share_prefix)(invocations)
    rows = split_rows(batch, num_rows=batch["input_ids"].shape[0] + 2, pad_token_id=7)
    assert len(rows) == batch["input_ids"].shape[0] + 2
    assert sum(r["num_real_tokens"] for r in rows) == batch["num_real_tokens"]
    assert sum(r["num_tokens_saved"] for r in rows) == batch["num_tokens_saved"]
    every_action = torch.cat([r["action_index"] for r in rows]).sort().values
    assert torch.equal(every_action, torch.arange(batch["num_action_tokens"]))
    assert all(r["input_ids"].shape == (1, r["num_real_tokens"]) for r in rows[:-2]), "no row padding"
    assert [r["input_ids"].tolist() for r in rows[-2:]] == [[[7]], [[7]]] and not rows[-1]["action_index"].numel()
    m = model("qwen2", attn_implementation)
    with torch.no_grad():
        alone = full_logits_action_logprobs(m, invocations)
        out = torch.full_like(alone, float("nan"))
        for row in rows:
            out[row["action_index"]] = action_logprobs(m, row)
    torch.testing.assert_close(out, alone, atol=ATOL, rtol=0)


def test_split_rows_refuses_a_padded_batch(invocations):
    with pytest.raises(ValueError, match="packed batch"):
        split_rows(PaddedInvocationCollator()(invocations[:2]))


def test_balanced_rows_use_no_more_rows_and_no_wider_rows_than_first_fit_decreasing():
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):
        lengths = torch.randint(1, 60, (int(torch.randint(1, 40, (1,), generator=generator)),), generator=generator)
        lengths = lengths.tolist()
        ffd, rows = first_fit_decreasing(lengths, 100), balanced_rows(lengths, 100)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert len(rows) <= len(ffd)
        width = max(sum(lengths[i] for i in row) for row in rows)
        assert width <= min(100, max(sum(lengths[i] for i in row) for row in ffd))
    # First-fit decreasing leaves the last of 3 rows nearly empty; balanced rows share the load.
    assert first_fit_decreasing([50, 50, 50, 50, 10], 100) == [[0, 1], [2, 3], [4]]
    assert balanced_rows([50, 50, 50, 50, 10], 100) == [[0, 3], [1, 4], [2]]


def transformers_tree_mask_function(batch):
    """
    The tree rule in transformers' mask functions: causal, and the key in the query's own segment (a packed sequence)
    or in the prefix that segment continues.
    """
    segment, prefix_segment = attention._tree_segments(batch)  # (rows, width) each

    def in_continued_prefix(batch_idx, head_idx, q_idx, kv_idx):
        return prefix_segment[batch_idx, q_idx] == segment[batch_idx, kv_idx]

    return and_masks(causal_mask_function, or_masks(packed_sequence_mask_function(segment), in_continued_prefix))


@pytest.mark.parametrize("max_tokens_per_row", [None, 64, 128], ids=["one-row", "rows-64", "rows-128"])
def test_the_tree_mask_is_the_one_transformers_mask_functions_build(invocations, max_tokens_per_row):
    # Two invocations that share nothing (segments that continue no prefix) beside the trees, split in rows of 64.
    unshared = [Invocation([9, 8, 7], [1, 2]), Invocation([3], [4])]
    batch = shared([*invocations, *unshared], max_tokens_per_row=max_tokens_per_row)
    rows, width = batch["input_ids"].shape
    assert batch["num_tokens_saved"] > 0 and (rows == 1 or (batch["invocation_index"] == -1).any())  # rows padded
    mask_function = transformers_tree_mask_function(batch)
    expected = sdpa_mask(rows, width, width, mask_function=mask_function, allow_is_causal_skip=False)
    assert torch.equal(tree_attention_mask(batch), expected)
    for dtype in (torch.float32, torch.bfloat16):  # the additive mask of `eager` attention
        expected = eager_mask(rows, width, width, mask_function=mask_function, dtype=dtype)
        assert torch.equal(tree_attention_mask(batch, dtype), expected)


# ----- exactness --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attn_implementation", TREE_ATTENTION_IMPLEMENTATIONS)
def test_shared_scores_equal_each_invocation_scored_alone(architecture, attn_implementation, invocations):
    m = model(architecture, attn_implementation)
    batch = shared(invocations)
    assert batch["num_tokens_saved"] > 0 and batch["input_ids"].shape[0] >= 1
    with torch.no_grad():
        alone, alone_distributions = full_logits_action_logprobs(m, invocations, return_distributions=True)
        torch.testing.assert_close(action_logprobs(m, batch), alone, atol=ATOL, rtol=0)
    torch.testing.assert_close(action_log_distributions(m, batch), alone_distributions, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attn_implementation", TREE_ATTENTION_IMPLEMENTATIONS)
def test_persistent_history_can_share_prefixes_too(attn_implementation, invocations):
    m = model("llama", attn_implementation)
    history = dict(history="persistent")
    batch = shared(invocations, **history)
    assert batch["num_tokens_saved"] > 0
    with torch.no_grad():
        torch.testing.assert_close(
            action_logprobs(m, batch), action_logprobs(m, plain(invocations, **history)), atol=ATOL, rtol=0
        )


@pytest.mark.parametrize("attn_implementation", [VARLEN_SDPA, "sdpa"])
def test_gradients_through_a_shared_prefix_equal_those_of_the_unshared_batch(attn_implementation, invocations):
    m = model("qwen2", attn_implementation).train()
    grads = []
    for batch in (plain(invocations), shared(invocations)):
        m.zero_grad()
        action_logprobs(m, batch).sum().backward()
        grads.append({name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def test_gpt2_absolute_positions_continue_from_the_prefix(invocations):
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(config).eval()
    batch = shared(invocations)
    with torch.no_grad():
        alone = full_logits_action_logprobs(gpt2, invocations)
        torch.testing.assert_close(action_logprobs(gpt2, batch), alone, atol=ATOL, rtol=0)
        # An off-by-one in the remainders' positions is caught: GPT-2 adds a learned embedding per position.
        flat = batch["position_ids"].reshape(-1).clone()
        q = batch["tree_cu_seq_lens_q"].long()
        for start, end in zip(q[:-1].tolist(), q[1:].tolist(), strict=True):
            if flat[start] > 0:
                flat[start:end] -= 1
        shifted = {**batch, "position_ids": flat.view_as(batch["position_ids"])}
        assert (action_logprobs(gpt2, shifted) - alone).abs().max() > 1e-3


# ----- no sibling leak --------------------------------------------------------------------------------------------


def _change_one_remainder(invocations, batch):
    """
    Change the first remainder of the first tree (its last input token and its actions: not what orders or groups
    the invocations, so the layout stays the same); only its own scores may move, and its siblings come after it.
    """
    index = int(batch["invocation_index"].reshape(-1)[batch["tree_cu_seq_lens_q"][1]])
    inv = invocations[index]
    changed = list(invocations)
    changed[index] = Invocation(inv.input_ids[:-1] + [(inv.input_ids[-1] + 1) % VOCAB or 1], [3] * len(inv.output_ids))
    new_batch = shared(changed)
    assert torch.equal(new_batch["invocation_index"], batch["invocation_index"])  # same layout, same tree
    owner = gather_actions(batch["invocation_index"], batch["action_target_index"])  # (N,)
    return new_batch, owner != index


@pytest.mark.parametrize("attn_implementation", TREE_ATTENTION_IMPLEMENTATIONS)
def test_changing_one_remainder_leaves_its_siblings_unchanged(attn_implementation, invocations):
    m = model("llama", attn_implementation)
    batch = shared(invocations)
    new_batch, siblings = _change_one_remainder(invocations, batch)
    with torch.no_grad():
        before, after = action_logprobs(m, batch), action_logprobs(m, new_batch)
    assert not torch.allclose(before[~siblings], after[~siblings])
    torch.testing.assert_close(before[siblings], after[siblings], atol=1e-6, rtol=0)


def _leaky_mask(batch, dtype=torch.bool):
    """A wrong tree mask: causal over the whole row, so a remainder also sees its earlier siblings."""
    rows, width = batch["input_ids"].shape
    visible = torch.ones(rows, 1, width, width, dtype=torch.bool).tril()
    return visible if dtype == torch.bool else torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(dtype).min)


def _leaky_plan(cu_seq_lens_q, cu_seq_lens_k=None, key_index=None):
    """A wrong plan: each remainder's keys are everything from its prefix's start up to itself, siblings included."""
    if key_index is None:
        return real_segment_plan(cu_seq_lens_q)
    cu_q, cu_k = cu_seq_lens_q.long(), cu_seq_lens_k.long()
    keys, lengths = [], []
    for s in range(len(cu_q) - 1):
        first = int(key_index[cu_k[s]])
        keys.append(torch.arange(first, int(cu_q[s + 1])))
        lengths.append(len(keys[-1]))
    cu = torch.tensor([0, *lengths]).cumsum(0)
    return real_segment_plan(cu_seq_lens_q, cu, torch.cat(keys))


real_segment_plan = attention.segment_plan


@pytest.mark.parametrize("attn_implementation", [VARLEN_SDPA, "sdpa"])
def test_the_sibling_leak_test_fails_against_a_mask_that_lets_siblings_see_each_other(
    attn_implementation, invocations, monkeypatch
):
    monkeypatch.setattr(scoring, "tree_attention_mask", _leaky_mask)
    monkeypatch.setattr(attention, "segment_plan", _leaky_plan)
    m = model("llama", attn_implementation)
    batch = shared(invocations)
    new_batch, siblings = _change_one_remainder(invocations, batch)
    with torch.no_grad():
        before, after = action_logprobs(m, batch), action_logprobs(m, new_batch)
    assert (before[siblings] - after[siblings]).abs().max() > 1e-4


# ----- what cannot score a tree -----------------------------------------------------------------------------------


def test_an_attention_implementation_that_cannot_score_a_tree_is_refused(invocations):
    m = model("qwen2", "sdpa")
    m.config._attn_implementation = "flash_attention_2"  # only the check runs: it refuses before any forward
    with pytest.raises(ValueError, match="shares prefixes"):
        action_logprobs(m, shared(invocations))


def test_invalid_threshold_is_refused():
    with pytest.raises(ValueError, match="min_shared_prefix_length"):
        PackedInvocationCollator(share_prefix=True, min_shared_prefix_length=0)
