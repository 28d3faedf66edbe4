"""Answer metrics, following the official HotpotQA evaluation script.

The official script normalizes both strings (lower case, drop punctuation, drop the articles a/an/the, collapse
whitespace) and then compares bags of tokens. Two special cases matter: when either normalized string is `yes`, `no`
or `noanswer` and the two differ, F1 is 0 (no partial credit for "yes it is" against "yes"), and an empty overlap is 0.
"""

import re
import string
from collections import Counter


_SPECIAL_ANSWERS = ("yes", "no", "noanswer")
_PUNCTUATION = frozenset(string.punctuation)


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
