import pytest

from memopd_trl import exact_match, qa_f1
from memopd_trl.metrics import normalize_answer


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Eiffel Tower", "eiffel tower"),
        ("  a   cat,  an owl. ", "cat owl"),
        ("Theatre of the Absurd", "theatre of absurd"),  # "the" removed only as a whole word
        ("U.S.A.", "usa"),
        ("Tunnels &amp; Trolls", "tunnels amp trolls"),
        ("Beyoncé's", "beyoncés"),  # non-ASCII letters are kept, ASCII punctuation dropped
        ("", ""),
    ],
)
def test_normalize_answer_matches_official_rules(text, expected):
    assert normalize_answer(text) == expected


def test_f1_partial_overlap_hand_worked():
    # pred tokens: [eiffel, tower]; gold tokens: [eiffel, tower, in, paris] -> P=1, R=0.5, F1=2/3
    assert qa_f1("the Eiffel Tower", "Eiffel Tower in Paris") == pytest.approx(2 / 3)


def test_f1_counts_repeated_tokens_as_a_multiset():
    # pred [new, new, york] vs gold [new, york]: common = {new: 1, york: 1} -> P=2/3, R=1, F1=0.8
    assert qa_f1("new new york", "New York") == pytest.approx(0.8)


def test_f1_and_em_ignore_case_punctuation_articles_whitespace():
    assert qa_f1("The  Beatles!", "beatles") == 1.0
    assert exact_match("The  Beatles!", "beatles") == 1.0


@pytest.mark.parametrize(
    ("prediction", "gold"),
    [("yes", "no"), ("no", "yes"), ("yes it is", "yes"), ("yes", "yes it is"), ("noanswer", "no answer")],
)
def test_yes_no_noanswer_get_no_partial_credit(prediction, gold):
    assert qa_f1(prediction, gold) == 0.0
    assert exact_match(prediction, gold) == 0.0


def test_yes_matches_itself_after_normalization():
    assert qa_f1("Yes.", "yes") == 1.0
    assert exact_match("YES", "yes") == 1.0


def test_no_overlap_and_empty_prediction_score_zero():
    assert qa_f1("Paris", "London") == 0.0
    assert qa_f1("", "London") == 0.0
    assert qa_f1("the", "a") == 0.0  # both normalize to empty strings: no common tokens


def test_exact_match_is_strict_beyond_normalization():
    assert exact_match("Eiffel Tower", "Eiffel Tower in Paris") == 0.0
    assert exact_match("an apple", "Apple") == 1.0

