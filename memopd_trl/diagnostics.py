"""Measures of how useful a teacher is in the states a student reaches, and expert labels for those states.

On-policy distillation asks the teacher about the student's states, not the expert's. A teacher that imitated an
expert has only seen states the expert (and its scripted mistakes) reach; how well it acts from a student's states is
a question of its own:

- [`teacher_takeover`] lets the student play the first k turns of each held-out episode and the teacher finish it,
  and reports the F1 by k. At k = 0 it is the teacher's own F1; once k exceeds every student episode, the student's.
  A teacher that is useful in student states keeps the F1 high as k grows (until the student's early mistakes, a
  fact never kept in memory, cannot be undone).
- [`expert_labels`] replays a student's episodes in their environments and asks a scripted expert what it would do
  in each state the student visited (DAgger). The scripted expert reads only the chat messages, so it can act from
  any state; added to a teacher's imitation data (`OfflineConfig.dagger_questions`), these labels teach it to act
  where students go.

>>> from memopd_trl.diagnostics import teacher_takeover
>>> by_turn = teacher_takeover(student_engine, teacher_engine, world.evaluation)  # {0: {"f1": ...}, 1: {...}, ...}
"""

from collections.abc import Callable, Sequence
from typing import Any

from .records import Episode
from .rollout import RolloutEngine


def _scores(episodes: list[Episode]) -> dict[str, float]:
    count = max(1, len(episodes))
    return {
        "f1": sum(e.f1 for e in episodes) / count,
        "em": sum(e.em for e in episodes) / count,
        "mean_turns": sum(e.num_turns for e in episodes) / count,
    }


def teacher_takeover(
    student: RolloutEngine,
    teacher: RolloutEngine,
    records: list[dict[str, Any]],
    turns: Sequence[int] | None = None,
    return_episodes: bool = False,
) -> dict[int, dict[str, float]] | tuple[dict[int, dict[str, float]], dict[int, list[Episode]]]:
    """
    Greedy F1 / EM when the student plays the first k turns of each episode and the teacher finishes it, by k.

    For each k, one batched greedy rollout of `records` ([`RolloutEngine.rollout`] with `takeover=teacher`,
    `takeover_turn=k`): the student's engine builds and records every context, exact token ids as in training, and
    its model generates turns `0..k-1`; the teacher's model generates the turns from k on. The student's own greedy
    episodes are played first: for a k at least as long as the longest of them, the teacher never plays and the
    result is the student's own, so it is not rolled out again.

    Args:
        student (`RolloutEngine`): the engine of the model that starts each episode; its environments and its
            context settings are used throughout.
        teacher (`RolloutEngine`): the engine of the model that finishes; same tokenizer.
        records (`list[dict]`): the tasks (e.g. the held-out ones), one episode each.
        turns (`Sequence[int]`, *optional*): the values of k; defaults to `0..max_turns - 1` of the student's
            environment.
        return_episodes (`bool`, *optional*, defaults to `False`): also return the episodes of each k.

    Returns:
        `dict[int, dict[str, float]]`: for each k, the mean `f1`, `em` and `mean_turns` (episode length), and
        `taken_over`, the fraction of episodes still running at turn k (the teacher played at least one of their
        turns). With `return_episodes`, a pair: that and, for each k, its episodes.
    """
    if turns is None:
        turns = range(student.env_factory().max_turns)
    turns = list(turns)
    if any(not isinstance(k, int) or k < 0 for k in turns):
        raise ValueError(f"`turns` must hold ints >= 0, got {turns}.")
    own, _ = student.rollout(records, num_generations=1, greedy=True)
    longest = max((episode.num_turns for episode in own), default=0)
    results, played = {}, {}
    for k in turns:
        if k >= longest:
            episodes = own
        else:
            episodes, _ = student.rollout(records, num_generations=1, greedy=True, takeover=teacher, takeover_turn=k)
        taken_over = sum(episode.num_turns > k for episode in episodes) / max(1, len(episodes))
        results[k] = {**_scores(episodes), "taken_over": taken_over}
        played[k] = episodes
    return (results, played) if return_episodes else results


def expert_labels(
    engine: RolloutEngine,
    episodes: list[Episode],
    records: list[dict[str, Any]],
    expert: Callable[[list[dict[str, str]]], str],
) -> list[tuple[list[dict[str, str]], str]]:
    """
    The expert's action in every state the episodes visited: `(messages, action)` pairs for imitation (DAgger).

    Each episode is replayed in a fresh environment of `engine` (reset with its record, then stepped with the
    actions the model played, decoded as the engine decodes them), so the messages are those the model saw. A turn
    is labelled only when the messages render, through `engine`'s chat template, to exactly the recorded context
    ids; a context the engine had to shorten (or a replay that diverged) ends that episode's labels there.

    Args:
        engine (`RolloutEngine`): the engine that played `episodes` (its tokenizer, environments and stop strings).
        episodes (`list[Episode]`): the episodes, e.g. from `engine.rollout(records)`.
        records (`list[dict]`): the records they were played on, found by each episode's `record_id` (the `_id`).
        expert (`Callable[[list[dict]], str]`): the labeller, e.g. `SyntheticExpert()`: chat messages to action.

    Returns:
        `list[tuple[list[dict], str]]`: per labelled turn, in episode and turn order, the messages of that state and
        the expert's action, as [`expert_invocations`] takes them.
    """
    by_id = {str(record.get("_id", index)): record for index, record in enumerate(records)}
    missing = sorted({episode.record_id for episode in episodes} - set(by_id))
    if missing:
        raise ValueError(f"No record with `_id` {missing[0]!r} among `records`; pass the records the episodes played.")
    steps = []
    for episode in episodes:
        env = engine.env_factory()
        env.reset(by_id[episode.record_id])
        for invocation in episode.invocations:
            if env.done:
                break
            messages = env.messages()
            if engine._prompt_ids(messages) != list(invocation.input_ids):
                break
            steps.append((messages, expert(messages)))
            env.step(engine._action_text(invocation.output_ids, env.stop_strings))
    return steps
