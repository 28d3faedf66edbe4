import pytest

from memopd_trl import exact_match, multi_answer_em, multi_answer_f1, qa_f1
from memopd_trl.metrics import MULTI_ANSWER_SEPARATOR, multi_answer_scores, normalize_answer, split_multi_answer


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


# ----- multi-objective answers -----------------------------------------------------------------------------------


def test_multi_answer_is_the_mean_of_per_sub_question_scores_hand_worked():
    # part 1: "eiffel tower" vs "eiffel tower in paris" -> F1 2/3, EM 0; part 2: exact -> 1, 1. Mean: 5/6 and 1/2.
    scores = multi_answer_scores("the Eiffel Tower ; Porto", ["Eiffel Tower in Paris", "Porto"])
    assert scores["sub_f1"] == pytest.approx([2 / 3, 1.0]) and scores["sub_em"] == [0.0, 1.0]
    assert scores["f1"] == pytest.approx(5 / 6) and scores["em"] == 0.5
    assert multi_answer_f1("the Eiffel Tower ; Porto", ["Eiffel Tower in Paris", "Porto"]) == pytest.approx(5 / 6)
    assert multi_answer_em("the Eiffel Tower ; Porto", ["Eiffel Tower in Paris", "Porto"]) == 0.5


def test_multi_answer_parts_align_by_position_and_missing_parts_score_zero():
    gold = ["Porto", "painter", "yes"]
    assert multi_answer_f1("painter ; Porto ; yes", gold) == pytest.approx(1 / 3)  # no credit out of place
    assert multi_answer_f1("Porto ; painter", gold) == pytest.approx(2 / 3)  # the third part is missing
    assert multi_answer_f1("Porto", gold) == pytest.approx(1 / 3)
    assert multi_answer_f1(" ; painter", gold) == pytest.approx(1 / 3)  # an empty first part still holds its place
    assert multi_answer_f1("Porto ; painter ; yes ; extra", gold) == 1.0  # parts past the last question are ignored
    assert multi_answer_em("Porto ; painter ; no", gold) == pytest.approx(2 / 3)  # no partial credit on yes/no


def test_multi_answer_split_needs_the_semicolon_not_its_spaces():
    assert split_multi_answer("Porto;painter ;  yes") == ["Porto", "painter", "yes"]
    assert MULTI_ANSWER_SEPARATOR.join(["Porto", "painter"]) == "Porto ; painter"
    assert multi_answer_f1("Porto;painter", ["Porto", "painter"]) == 1.0
    assert multi_answer_f1("Porto painter", ["Porto", "painter"]) == pytest.approx(2 / 3 / 2)  # one part, half right


def test_normalization_cannot_produce_the_separator():
    assert ";" not in normalize_answer("a;b ; c")  # ASCII punctuation is dropped, so no gold answer holds it


def test_multi_answer_needs_a_list_of_gold_answers():
    with pytest.raises(ValueError, match="non-empty list"):
        multi_answer_f1("Porto", [])
    with pytest.raises(ValueError, match="non-empty list"):
        multi_answer_f1("Porto", "Porto ; painter")
