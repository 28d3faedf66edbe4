"""Answer metrics, following the official HotpotQA evaluation script.

The official script normalizes both strings (lower case, drop punctuation, drop the articles a/an/the, collapse
whitespace) and then compares bags of tokens. Two special cases matter: when either normalized string is `yes`, `no`
or `noanswer` and the two differ, F1 is 0 (no partial credit for "yes it is" against "yes"), and an empty overlap is 0.

A multi-objective task (several sub-questions, MEM1 style) is answered with its sub-answers joined by
`MULTI_ANSWER_SEPARATOR` (`" ; "`); its score is the mean of the per-sub-question scores (`multi_answer_f1`,
`multi_answer_em`). The separator's `;` is ASCII punctuation, which normalization deletes, so no normalized answer
contains it.
"""

import re
import string
from collections import Counter
from collections.abc import Sequence


_SPECIAL_ANSWERS = ("yes", "no", "noanswer")
_PUNCTUATION = frozenset(string.punctuation)
# Joins the sub-answers of a multi-objective task. A prediction is split on its `;` (spaces around it are optional).
MULTI_ANSWER_SEPARATOR = " ; "


def normalize_answer(text: str) -> str:
    """
    Normalize an answer the way HotpotQA's evaluation does.

    Returns:
        `str`: `text` lower-cased, without ASCII punctuation, without the articles a/an/the, with single spaces.
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def qa_f1(prediction: str, ground_truth: str) -> float:
    """
    Token-level F1 between a predicted and a gold answer, as in HotpotQA's official evaluation.

    Args:
        prediction (`str`): the predicted answer.
        ground_truth (`str`): the gold answer.

    Returns:
        `float`: F1 in `[0, 1]`. 0 when a yes/no/noanswer answer on either side does not match exactly.

    Example:

    ```python
    >>> from memopd_trl import qa_f1
    >>> round(qa_f1("the Eiffel Tower", "Eiffel Tower in Paris"), 4)
    0.6667
    ```
    """
    pred = normalize_answer(prediction)
    gold = normalize_answer(ground_truth)
    if (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens = pred.split()
    gold_tokens = gold.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, ground_truth: str) -> float:
    """
    Exact match after HotpotQA's answer normalization.

    Returns:
        `float`: 1.0 when the normalized strings are equal, else 0.0.

    Example:

    ```python
    >>> from memopd_trl import exact_match
    >>> exact_match("The Beatles!", "beatles")
    1.0
    ```
    """
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def split_multi_answer(prediction: str) -> list[str]:
    """
    Split the answer of a multi-objective task into its parts.

    Args:
        prediction (`str`): sub-answers joined by `MULTI_ANSWER_SEPARATOR` (any `;` splits, spaces around it are
            optional and stripped).

    Returns:
        `list[str]`: the parts, in order (one part when `prediction` holds no `;`).

    Example:

    ```python
    >>> from memopd_trl.metrics import split_multi_answer
    >>> split_multi_answer("Porto ; painter;yes")
    ['Porto', 'painter', 'yes']
    ```
    """
    return [part.strip() for part in prediction.split(MULTI_ANSWER_SEPARATOR.strip())]


def multi_answer_scores(prediction: str, sub_answers: Sequence[str]) -> dict[str, float | list[float]]:
    """
    Score the answer of a multi-objective task: split it on the separator (`split_multi_answer`), align the parts with
    the gold sub-answers by position, and score each pair with `qa_f1` and `exact_match`. A missing part scores 0;
    parts beyond the last sub-answer are ignored.

    Args:
        prediction (`str`): the predicted answer, e.g. `"Porto ; painter"`.
        sub_answers (`Sequence[str]`): the gold sub-answers, in question order (at least one).

    Returns:
        `dict`: `f1` and `em`, the means over the sub-questions, and `sub_f1`, `sub_em`, the per-sub-question
        scores.
    """
    if isinstance(sub_answers, str) or len(sub_answers) == 0:
        raise ValueError(f"`sub_answers` must be a non-empty list of gold answers, got {sub_answers!r:.120}.")
    parts = split_multi_answer(prediction)
    parts += [""] * (len(sub_answers) - len(parts))
    sub_f1 = [qa_f1(part, gold) for part, gold in zip(parts, sub_answers, strict=False)]
    sub_em = [exact_match(part, gold) for part, gold in zip(parts, sub_answers, strict=False)]
    return {"f1": sum(sub_f1) / len(sub_f1), "em": sum(sub_em) / len(sub_em), "sub_f1": sub_f1, "sub_em": sub_em}


def multi_answer_f1(prediction: str, sub_answers: Sequence[str]) -> float:
    """
    F1 of a multi-objective task's answer: the mean over its sub-questions of `qa_f1` between the prediction's part at
    that position (split on `MULTI_ANSWER_SEPARATOR`) and the gold sub-answer; a missing part scores 0.

    Returns:
        `float`: F1 in `[0, 1]`.

    Example:

    ```python
    >>> from memopd_trl import multi_answer_f1
    >>> multi_answer_f1("Porto ; Lisbon", ["Porto", "Madrid"])
    0.5
    ```
    """
    return multi_answer_scores(prediction, sub_answers)["f1"]


def multi_answer_em(prediction: str, sub_answers: Sequence[str]) -> float:
    """
    Exact match of a multi-objective task's answer: the mean over its sub-questions of `exact_match` of the part at
    that position; a missing part scores 0.

    Returns:
        `float`: the fraction of sub-questions answered exactly, in `[0, 1]`.

    Example:

    ```python
    >>> from memopd_trl import multi_answer_em
    >>> multi_answer_em("The Porto", ["Porto", "Madrid"])
    0.5
    ```
    """
    return multi_answer_scores(prediction, sub_answers)["em"]
