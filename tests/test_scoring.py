"""State-aligned scoring on real tiny Qwen2 and Llama models (fp32, CPU)."""

import itertools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from transformers import AttentionInterface
from transformers.integrations.flex_attention import WrappedFlexAttention

from memopd_trl import scoring
from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention, varlen_sdpa_attention
from memopd_trl.packing import PackedInvocationCollator, PaddedInvocationCollator, gather_actions
from memopd_trl.records import Invocation
from memopd_trl.scoring import (
    action_hidden_states,
    action_log_distributions,
    action_logprobs,
    action_logprobs_from_hidden,
    action_token_ids,
    full_logits_action_logprobs,
    lm_head_params,
    packed_hidden_states,
)
from tiny_models import tiny_causal_lm


VOCAB = 256
ATOL = 1e-5


def random_ids(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=generator).tolist()


def make_invocations(sizes: list[tuple[int, int]], seed: int = 0) -> list[Invocation]:
    generator = torch.Generator().manual_seed(seed)
    return [
        Invocation(random_ids(a, generator), random_ids(b, generator), episode_id=i) for i, (a, b) in enumerate(sizes)
    ]


SIZES = [(12, 4), (5, 3), (20, 6), (7, 1), (3, 2), (9, 5), (15, 0), (2, 7)]


@pytest.fixture(scope="module")
def invocations() -> list[Invocation]:
    return make_invocations(SIZES)


@pytest.fixture(scope="module")
def packed(invocations) -> dict:
    batch = PackedInvocationCollator(max_tokens_per_row=32)(invocations)
    # The test is only meaningful if rows really hold several invocations.
    per_row = [len({i for i in row if i >= 0}) for row in batch["invocation_index"].tolist()]
    assert max(per_row) >= 3, per_row
    return batch


_MODELS: dict = {}


def tiny_model(architecture: str = "qwen2", attn_implementation: str = "sdpa", seed: int = 0):
    key = (architecture, attn_implementation, seed)
    if key not in _MODELS:
        _MODELS[key] = tiny_causal_lm(
            VOCAB, architecture=architecture, attn_implementation=attn_implementation, seed=seed
        )
    return _MODELS[key]


def _alone(model, invocations: list[Invocation]) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return full_logits_action_logprobs(model, invocations, return_distributions=True)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager", VARLEN_SDPA])
def test_packed_scores_equal_each_invocation_scored_alone(architecture, attn_implementation, invocations, packed):
    model = tiny_model(architecture, attn_implementation)
    ref_logprobs, ref_distributions = _alone(model, invocations)
    with torch.no_grad():
        logprobs = action_logprobs(model, packed, chunk_size=5)
        distributions = action_log_distributions(model, packed)
    assert logprobs.shape == (sum(b for _, b in SIZES),)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(distributions, ref_distributions, atol=ATOL, rtol=0)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_padded_collator_gives_the_same_scores_as_packed(architecture, invocations, packed):
    model = tiny_model(architecture)
    padded = PaddedInvocationCollator()(invocations)
    with torch.no_grad():
        torch.testing.assert_close(action_logprobs(model, padded), action_logprobs(model, packed), atol=ATOL, rtol=0)


def test_temperature_and_entropy_match_the_full_logits_distribution(invocations, packed):
    model = tiny_model()
    with torch.no_grad():
        logprobs, entropy = action_logprobs(model, packed, temperature=0.7, chunk_size=4, return_entropy=True)
        ref_logprobs, ref_dist = full_logits_action_logprobs(model, invocations, 0.7, return_distributions=True)
    torch.testing.assert_close(logprobs, ref_logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(entropy, -(ref_dist.exp() * ref_dist).sum(-1), atol=ATOL, rtol=0)


def _logprobs_from_hidden(model, batch: dict, hidden: torch.Tensor) -> torch.Tensor:
    ati = batch["action_target_index"]
    logits = model.lm_head(gather_actions(hidden[:, :-1], ati[:, 1:]))
    return logits.log_softmax(-1).gather(-1, gather_actions(batch["input_ids"], ati)[:, None]).squeeze(-1)


def test_forgetting_the_packed_forward_rules_changes_the_scores_but_packed_hidden_states_is_not_fooled(
    invocations, packed
):
    model = tiny_model()
    decoder = model.get_decoder()
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    with torch.no_grad():
        right = _logprobs_from_hidden(model, packed, decoder(**inputs, use_cache=False).last_hidden_state)
        with_cache = _logprobs_from_hidden(model, packed, decoder(**inputs).last_hidden_state)
        ones = torch.ones_like(packed["input_ids"])
        all_ones = decoder(**inputs, attention_mask=ones, use_cache=False).last_hidden_state
        with_ones_mask = _logprobs_from_hidden(model, packed, all_ones)
        guarded = action_logprobs(model, {**packed, "attention_mask": ones})
    ref, _ = _alone(model, invocations)
    torch.testing.assert_close(right, ref, atol=ATOL, rtol=0)
    # Either mistake lets invocations attend to earlier ones in their row: the scores move by far more than noise.
    assert (with_cache - ref).abs().max() > 1e-2
    assert (with_ones_mask - ref).abs().max() > 1e-2
    torch.testing.assert_close(guarded, ref, atol=ATOL, rtol=0)


def test_packed_rows_with_a_partial_attention_mask_are_refused(packed):
    mask = torch.ones_like(packed["input_ids"])
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="remove `attention_mask`"):
        packed_hidden_states(tiny_model(), {**packed, "attention_mask": mask})


def test_changing_one_invocation_leaves_the_others_in_its_row_unchanged(invocations, packed):
    model = tiny_model("llama")
    # The first invocation of the first row that holds several.
    row = next(r for r in packed["invocation_index"].tolist() if len(set(r) - {-1}) > 1)
    changed_index = row[0]
    neighbours = {i for i in row if i not in (-1, changed_index)}
    assert neighbours, "the row must hold other invocations"
    generator = torch.Generator().manual_seed(123)
    changed = list(invocations)
    old = invocations[changed_index]
    changed[changed_index] = Invocation(
        random_ids(len(old.input_ids), generator), random_ids(len(old.output_ids), generator), episode_id=99
    )
    new_batch = PackedInvocationCollator(max_tokens_per_row=32)(changed)
    assert torch.equal(new_batch["invocation_index"], packed["invocation_index"])  # same layout
    with torch.no_grad():
        before, after = action_logprobs(model, packed), action_logprobs(model, new_batch)
    owner = gather_actions(packed["invocation_index"], packed["action_target_index"])  # (N,)
    assert not torch.allclose(before[owner == changed_index], after[owner == changed_index])
    others = owner != changed_index
    torch.testing.assert_close(before[others], after[others], atol=1e-6, rtol=0)


def _episode(persistent_policy: bool, seed: int, episode_id: int, turns: int = 3) -> list[Invocation]:
    """
    One hand-built episode. With a compact memory policy, turn k+1 sees prompt + previous action + new observation
    (shorter than the full history); with a persistent policy it sees everything so far.
    """
    generator = torch.Generator().manual_seed(seed)
    prompt = random_ids(6, generator)
    observations = [random_ids(12, generator) for _ in range(turns)]
    actions = [random_ids(5, generator) for _ in range(turns)]
    invocations, context = [], prompt + observations[0]
    for k in range(turns):
        next_observation = observations[k + 1] if k + 1 < turns else None
        invocations.append(
            Invocation(list(context), actions[k], episode_id=episode_id, turn=k, observation_ids=next_observation)
        )
        if next_observation is not None:
            context = (context if persistent_policy else prompt) + actions[k] + next_observation
    return invocations


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_persistent_history_equals_aligned_only_for_a_persistent_memory_policy(architecture):
    model = tiny_model(architecture, seed=1)
    persistent_policy = _episode(True, seed=5, episode_id=0) + _episode(True, seed=6, episode_id=1)
    compact_policy = _episode(False, seed=5, episode_id=0) + _episode(False, seed=6, episode_id=1)
    scores = {}
    with torch.no_grad():
        for name, episodes in (("persistent policy", persistent_policy), ("compact policy", compact_policy)):
            aligned = action_logprobs(model, PackedInvocationCollator()(episodes))
            flattened = action_logprobs(model, PackedInvocationCollator(history="persistent")(episodes))
            torch.testing.assert_close(aligned, full_logits_action_logprobs(model, episodes), atol=ATOL, rtol=0)
            scores[name] = (aligned, flattened)
    aligned, flattened = scores["persistent policy"]
    torch.testing.assert_close(flattened, aligned, atol=ATOL, rtol=0)

    aligned, flattened = scores["compact policy"]
    gap = (flattened - aligned).abs()  # (N,) per-action error of persistent-history scoring
    first_turn = torch.tensor([1] * 5 + [0] * 10 + [1] * 5 + [0] * 10, dtype=torch.bool)
    print(f"\n{architecture}: persistent-vs-aligned |log-prob gap| after a rewrite: max {gap[~first_turn].max():.4f}")
    torch.testing.assert_close(flattened[first_turn], aligned[first_turn], atol=ATOL, rtol=0)  # same state at turn 0
    assert gap[~first_turn].max() > 1e-3


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_chunked_logprob_gradient_equals_the_unchunked_and_full_logits_gradients(architecture, invocations, packed):
    model = tiny_model(architecture, seed=2)
    weights = torch.randn(sum(b for _, b in SIZES), generator=torch.Generator().manual_seed(0))

    def grads(score) -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (score() * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    chunked = grads(lambda: action_logprobs(model, packed, chunk_size=3))
    unchunked = grads(lambda: action_logprobs(model, packed, chunk_size=10_000))
    full = grads(lambda: full_logits_action_logprobs(model, invocations))
    model.zero_grad(set_to_none=True)
    assert any(g.abs().max() > 0 for g in chunked)
    for a, b, c in zip(chunked, unchunked, full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)


def test_action_hidden_states_and_lm_head_params_shapes(packed):
    model = tiny_model()
    with torch.no_grad():
        hidden = action_hidden_states(model, packed)
    weight, bias = lm_head_params(model)
    assert hidden.shape == (packed["num_action_tokens"], model.config.hidden_size)
    assert weight.shape == (VOCAB, model.config.hidden_size) and bias is None


def test_logprobs_from_hidden_states_match_the_model_path_and_return_a_pair(packed):
    model = tiny_model()
    with torch.no_grad():
        hidden = action_hidden_states(model, packed)
        weight, bias = lm_head_params(model)
        logprobs, entropy = action_logprobs_from_hidden(hidden, weight, bias, action_token_ids(packed), chunk_size=3)
        expected = action_logprobs(model, packed)
    assert entropy is None
    torch.testing.assert_close(logprobs, expected, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="one each"):
        action_logprobs_from_hidden(hidden, weight, bias, action_token_ids(packed)[:-1])


def test_batch_without_any_action_gives_empty_scores():
    batch = PackedInvocationCollator()(make_invocations([(4, 0), (3, 0)]))
    with torch.no_grad():
        logprobs, entropy = action_logprobs(tiny_model(), batch, return_entropy=True)
    assert logprobs.shape == entropy.shape == (0,)


def test_action_at_the_start_of_a_sequence_is_refused():
    batch = PackedInvocationCollator()(make_invocations([(4, 2)]))
    batch["action_target_index"] = torch.tensor([[0, -1, -1, -1, -1, 1]])
    with pytest.raises(ValueError, match="no earlier token predicts it"):
        action_logprobs(tiny_model(), batch)


class _DistributedStandIn(torch.nn.Module):
    """Like DDP: keeps the model in `.module`, exposes neither `config` nor `get_decoder`."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, **kwargs):
        return self.module(**kwargs)


def test_wrapped_model_is_scored_through_its_own_forward(invocations, packed):
    model = tiny_model("llama")
    with torch.no_grad():
        wrapped = action_logprobs(_DistributedStandIn(model), packed)
        torch.testing.assert_close(wrapped, _alone(model, invocations)[0], atol=ATOL, rtol=0)


def test_peft_model_with_a_trained_head_copy_matches_its_own_full_forward(invocations, packed):
    peft = pytest.importorskip("peft")
    base = tiny_causal_lm(VOCAB, seed=3)
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], init_lora_weights=False
    )
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modules_to_save" in name:  # make the trained copy differ from the frozen original head
                param.add_(0.5 * torch.randn_like(param))
        torch.testing.assert_close(action_logprobs(model, packed), _alone(model, invocations)[0], atol=ATOL, rtol=0)


def test_peft_adapter_on_the_lm_head_is_refused(packed):
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_causal_lm(VOCAB, seed=4), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="LM head carries a PEFT adapter"):
        lm_head_params(model)


def _reference_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """What flash-attention's varlen kernel computes: causal attention inside each `cu_seq_lens` span, flattened."""
    assert attention_mask is None, "varlen attention must not receive an attention mask"
    cu_seq_lens = kwargs["cu_seq_lens_q"].tolist()  # KeyError here means the kwargs did not reach attention
    assert kwargs["max_length_q"] == max(b - a for a, b in itertools.pairwise(cu_seq_lens))
    batch, heads, seq_len, head_dim = query.shape  # (batch, heads, seq_len, head_dim)
    groups = heads // key.shape[1]
    q, k, v = (
        x.repeat_interleave(g, dim=1).transpose(1, 2).reshape(batch * seq_len, heads, head_dim)
        for x, g in ((query, 1), (key, groups), (value, groups))
    )  # each (batch * seq_len, heads, head_dim)
    out = torch.empty_like(q)
    for start, end in itertools.pairwise(cu_seq_lens):
        span = [x[start:end].transpose(0, 1) for x in (q, k, v)]  # (heads, span, head_dim)
        out[start:end] = F.scaled_dot_product_attention(*span, is_causal=True, scale=scaling).transpose(0, 1)
    return out.view(batch, seq_len, heads, head_dim), None


def test_flash_varlen_fields_keep_invocations_apart_across_several_rows(invocations, packed, monkeypatch):
    name = "memopd_reference_varlen"
    AttentionInterface.register(name, _reference_varlen_attention)
    monkeypatch.setattr(scoring, "VARLEN_ATTENTION_IMPLEMENTATIONS", {name})
    model = tiny_causal_lm(VOCAB, architecture="qwen2", seed=0)
    model.set_attn_implementation(name)
    assert packed["input_ids"].shape[0] > 1
    with torch.no_grad():
        logprobs = action_logprobs(model, packed)
    torch.testing.assert_close(logprobs, _alone(tiny_model("qwen2", "sdpa", 0), invocations)[0], atol=ATOL, rtol=0)


def test_the_varlen_attention_is_registered_by_its_function_only_and_again_changes_nothing():
    # Importing the library (trainer included) registers nothing with transformers: `register_varlen_attention` does.
    probe = (
        "from transformers import AttentionInterface\n"
        "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
        "import memopd_trl.scoring, memopd_trl.trainer\n"
        "from memopd_trl.attention import VARLEN_SDPA, register_varlen_attention\n"
        "before = VARLEN_SDPA in AttentionInterface._global_mapping or VARLEN_SDPA in ALL_MASK_ATTENTION_FUNCTIONS\n"
        "register_varlen_attention()\n"
        "print(before, VARLEN_SDPA in AttentionInterface._global_mapping, VARLEN_SDPA in ALL_MASK_ATTENTION_FUNCTIONS)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True", "True"]
    register_varlen_attention()
    register_varlen_attention()
    assert AttentionInterface._global_mapping[VARLEN_SDPA] is varlen_sdpa_attention


def test_varlen_sdpa_student_gradients_equal_those_of_sdpa(packed):
    sdpa, varlen = tiny_causal_lm(VOCAB, seed=5), tiny_causal_lm(VOCAB, seed=5, attn_implementation=VARLEN_SDPA)
    for model in (sdpa, varlen):
        action_logprobs(model, packed, chunk_size=8).mean().backward()
    for (name, a), b in zip(sdpa.named_parameters(), varlen.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-4, msg=name)


def test_varlen_sdpa_without_varlen_fields_is_plain_sdpa_for_padding_and_generation(invocations):
    sdpa, varlen = tiny_model("llama"), tiny_causal_lm(VOCAB, architecture="llama", attn_implementation=VARLEN_SDPA)
    padded = PaddedInvocationCollator()(invocations)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # left padding, as in batched generation
    with torch.no_grad():
        torch.testing.assert_close(action_logprobs(varlen, padded), action_logprobs(sdpa, padded), atol=ATOL, rtol=0)
        generated = [
            model.generate(
                input_ids=prompts, attention_mask=attention_mask, max_new_tokens=6, do_sample=False, pad_token_id=0
            )
            for model in (sdpa, varlen)
        ]
    assert torch.equal(generated[0], generated[1])


def test_flex_attention_with_gradients_on_cpu_raises_a_clear_error(packed):
    model = tiny_model("qwen2", "flex_attention")
    with pytest.raises(ValueError, match="flex_attention has no backward pass on CPU"):
        action_logprobs(model, packed)


@pytest.mark.slow
def test_flex_attention_scores_packed_rows_without_gradients_on_cpu(invocations, packed, monkeypatch):
    model = tiny_model("llama", "flex_attention")
    # A positions-continuous copy of the same rows: no restart to detect, so every invocation attends to the ones
    # before it in its row. This is the failure the test guards against; it must sit far outside the tolerance.
    leaky = dict(packed, position_ids=torch.arange(packed["position_ids"].shape[1]).expand_as(packed["position_ids"]))
    # The mask is what is under test, so flex runs its reference math (dynamo's `aot_eager` backend) instead of
    # inductor's compiled CPU kernel, which is not bit-stable across CPUs (up to ~2e-2 nats apart were seen).
    reference_flex = torch.compile(flex_attention, backend="aot_eager", fullgraph=True)
    monkeypatch.setattr(WrappedFlexAttention, "__call__", lambda self: reference_flex)
    with torch.no_grad():
        reference = _alone(model, invocations)[0]
        logprobs = action_logprobs(model, packed)
        leaky_logprobs = action_logprobs(model, leaky)
    assert (leaky_logprobs - reference).abs().max() > 1e3 * ATOL
    torch.testing.assert_close(logprobs, reference, atol=ATOL, rtol=0)
