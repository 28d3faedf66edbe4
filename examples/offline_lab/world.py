"""A seeded, offline world of multi-hop questions in HotpotQA's own format.

The world is made of invented entities (names built from syllables, so no model knows them in advance) of three kinds
(films, companies and people) and a few relations between them. Every entity with a passage is described by one short
fact sentence, sometimes followed by a filler sentence:

    Kalo Venu is a 1987 film directed by Tamir Oslen.
    Drava Menko is a company founded in 1954 by Sela Brin.
    Tamir Oslen is a painter born in Dravik. They later lived in Orsa.

Questions follow six templates. Bridge questions need a fact about an entity named only in another passage ("Where
was the director of Kalo Venu born?": the film's passage names the director, the director's passage gives the city);
comparison questions need one fact from each of two passages ("Which company was founded first, A or B?", "Were A and
B born in the same city?"). For every gold passage the world also writes distractor passages about entities of the
same kind whose names share a word with it, so a query must match the whole name.

The world is kept regular on purpose: a tiny transformer trained from scratch for minutes must learn to act in it. The
answers are copied verbatim from passages, or are `yes` / `no`.
"""

import gc
import json
import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# Syllables that invented names are built from (a tokenizer can keep their capitalized forms as single tokens).
NAME_SYLLABLES = (
    "ka", "lo", "mi", "ra", "tu", "ve", "sa", "no", "di", "pe", "zu", "ri", "ba", "ku", "to", "li", "da", "mo", "vi",
    "gu", "ta", "shi", "ren", "vel", "dor", "mar", "tes", "lun", "bri", "kor", "sel", "nim", "val", "dru", "pa", "go",
    "ze", "zo",
)  # fmt: skip
OCCUPATIONS = (
    "painter", "chemist", "architect", "engineer", "poet", "violinist", "botanist", "sculptor", "historian",
    "surgeon", "photographer", "novelist",
)  # fmt: skip
# Words that must never be part of an invented name: every word of the templates, and short English words.
_RESERVED = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these they this "
    "to was will with film company directed founded born later lived main office filmed which were same city first "
    "more recently released where what who director founder occupation yes".split()
) | frozenset(OCCUPATIONS)

FILM_FACT = "{name} is a {year} film directed by {director}."
COMPANY_FACT = "{name} is a company founded in {year} by {founder}."
PERSON_FACT = "{name} is {article} {occupation} born in {city}."
FILLERS = {
    "film": "It was filmed in {city}.",
    "company": "Its main office is in {city}.",
    "person": "They later lived in {city}.",
}

# name -> (question type, template). `{a}` / `{b}` are the entities the question names.
QUESTION_TEMPLATES = {
    "director_birthplace": ("bridge", "Where was the director of {a} born?"),
    "founder_birthplace": ("bridge", "Where was the founder of {a} born?"),
    "director_occupation": ("bridge", "What is the occupation of the director of {a}?"),
    "founded_first": ("comparison", "Which company was founded first, {a} or {b}?"),
    "released_later": ("comparison", "Which film was released more recently, {a} or {b}?"),
    "same_birthplace": ("comparison", "Were {a} and {b} born in the same city?"),
    # Single-hop lookups (one passage answers them), asked only when `lookup_fraction > 0`.
    "film_director": ("lookup", "Who directed {a}?"),
    "company_founder": ("lookup", "Who founded {a}?"),
    "person_birthplace": ("lookup", "Where was {a} born?"),
    "person_occupation": ("lookup", "What is the occupation of {a}?"),
}
BRIDGE_TEMPLATES = tuple(k for k, (t, _) in QUESTION_TEMPLATES.items() if t == "bridge")
COMPARISON_TEMPLATES = tuple(k for k, (t, _) in QUESTION_TEMPLATES.items() if t == "comparison")
LOOKUP_TEMPLATES = tuple(k for k, (t, _) in QUESTION_TEMPLATES.items() if t == "lookup")
# Kind of the entities each question names: what the first search of each must find.
QUESTION_ENTITY_KIND = {
    "director_birthplace": "film",
    "founder_birthplace": "company",
    "director_occupation": "film",
    "founded_first": "company",
    "released_later": "film",
    "same_birthplace": "person",
    "film_director": "film",
    "company_founder": "company",
    "person_birthplace": "person",
    "person_occupation": "person",
}
# What a lookup's answer is: the field of its entity's fact (`find_fact`).
LOOKUP_ANSWER_FIELD = {
    "film_director": "director",
    "company_founder": "founder",
    "person_birthplace": "city",
    "person_occupation": "occupation",
}

_NAME = r"[A-Z][a-z]+ [A-Z][a-z]+"
_QUESTION_PATTERNS = {
    key: re.compile(re.escape(template).replace(r"\{a\}", f"({_NAME})").replace(r"\{b\}", f"({_NAME})"))
    for key, (_, template) in QUESTION_TEMPLATES.items()
}


def parse_question(text: str) -> tuple[str, tuple[str, ...]] | None:
    """
    Recognize a synthetic question inside `text` (which may hold other words around it).

    Returns:
        `tuple[str, tuple[str, ...]]` or `None`: the template name and the entity names the question mentions, or
        `None` when `text` holds no synthetic question.
    """
    for key, pattern in _QUESTION_PATTERNS.items():
        match = pattern.search(text)
        if match:
            return key, match.groups()
    return None


def find_fact(kind: str, name: str, text: str) -> dict[str, str] | None:
    """
    Find the fact sentence about entity `name` of kind `kind` (`"film"`, `"company"` or `"person"`) in `text`.

    Returns:
        `dict` or `None`: the fields of the fact (`sentence`, `name`, and `year` + `director`, `year` + `founder` or
        `occupation` + `city`), or `None` when `text` does not state it.
    """
    head = rf"(?<![A-Za-z]){re.escape(name)} is "
    if kind == "film":
        match = re.search(head + rf"a (?P<year>\d{{4}}) film directed by (?P<director>{_NAME})\.", text)
    elif kind == "company":
        match = re.search(head + rf"a company founded in (?P<year>\d{{4}}) by (?P<founder>{_NAME})\.", text)
    elif kind == "person":
        match = re.search(head + r"an? (?P<occupation>[a-z]+) born in (?P<city>[A-Z][a-z]+)\.", text)
    else:
        raise ValueError(f"Unknown entity kind {kind!r}; choose 'film', 'company' or 'person'.")
    if match is None:
        return None
    return {"sentence": match.group(0), "name": name, **match.groupdict()}


@dataclass
class SyntheticWorld:
    """
    A synthetic multi-hop QA world.

    Parameters:
        records (`list[dict]`):
            Questions in HotpotQA's official layout: `_id`, `answer`, `question`, `supporting_facts`
            (`[[title, sent_id], ...]`), `context` (`[[title, [sentences]], ...]`), `type` and `level`.
        corpus (`list[dict]`):
            Every passage of the world, `{"title": str, "text": str}`, titles unique.
        seed (`int`, *optional*, defaults to `0`):
            Seed the world was made with.
        meta (`dict`, *optional*):
            The other arguments of `make_synthetic_world`, for the record.

    Example:

    ```python
    >>> from offline_lab import make_synthetic_world
    >>> world = make_synthetic_world(4, seed=0)
    >>> sorted(world.records[0])
    ['_id', 'answer', 'context', 'level', 'question', 'supporting_facts', 'type']
    ```
    """

    records: list[dict[str, Any]]
    corpus: list[dict[str, str]]
    seed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def texts(self) -> list[str]:
        """
        Returns:
            `list[str]`: every text of the world (passages, questions, answers), e.g. to train a tokenizer.
        """
        return [p["text"] for p in self.corpus] + [r["question"] for r in self.records] + ["yes", "no"]

    def to_json(self, path: str | Path) -> None:
        """Write the world to `path` as one JSON object (`records`, `corpus`, `seed`, `meta`)."""
        payload = {"format": "memopd-synthetic-world", "version": 1, "seed": self.seed, "meta": self.meta}
        payload |= {"records": self.records, "corpus": self.corpus}
        Path(path).write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def from_json(cls, path: str | Path) -> "SyntheticWorld":
        """
        Read a world written by `to_json`.

        Returns:
            `SyntheticWorld`: the world, equal to the one written.
        """
        payload = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(payload, dict) or payload.get("format") != "memopd-synthetic-world":
            raise ValueError(f"{path} is not a synthetic world written by `SyntheticWorld.to_json`.")
        return cls(records=payload["records"], corpus=payload["corpus"], seed=payload["seed"], meta=payload["meta"])


class _WorldBuilder:
    """Makes entities with unique names, their passages and the questions over them."""

    def __init__(self, rng: random.Random, num_cities: int, filler_prob: float, short_names: bool = False):
        self.rng = rng
        self.filler_prob = filler_prob
        self.short_names = short_names
        # Every word of two or three syllables, in a fixed order; names and cities are drawn from these.
        two = [(a + b).capitalize() for a in NAME_SYLLABLES for b in NAME_SYLLABLES]
        three = [(a + b + c).capitalize() for a in NAME_SYLLABLES for b in NAME_SYLLABLES for c in NAME_SYLLABLES]
        two = [w for w in two if w.lower() not in _RESERVED]
        three = [w for w in three if w.lower() not in _RESERVED]
        self.syllables: dict[str, tuple[str, ...]] = {}
        if short_names:  # two syllables a word, none repeated: a name copies token by token without ambiguity
            self.syllables = {(a + b).capitalize(): (a, b) for a in NAME_SYLLABLES for b in NAME_SYLLABLES if a != b}
            two = [w for w in two if w in self.syllables]
            three = []
        cities: dict[str, None] = {}  # insertion-ordered set
        while len(cities) < num_cities:
            cities[self._pick(two, three)] = None
        self.cities = list(cities)
        self.two = [w for w in two if w not in cities]
        self.three = [w for w in three if w not in cities]
        self.used_words: set[frozenset[str]] = set()  # names as word sets: "Kalo Venu" and "Venu Kalo" collide
        self.passages: dict[str, list[str]] = {}  # title -> sentences (HotpotQA layout: later ones start with a space)

    def _pick(self, two: list[str], three: list[str]) -> str:
        words = two if not three or self.rng.random() < 0.5 else three
        return words[self.rng.randrange(len(words))]

    def _name_word(self) -> str:
        return self._pick(self.two, self.three)

    def name(self, share_with: str | None = None) -> str:
        """A new unique two-word name; with `share_with`, one of its words is taken from that name."""
        while True:
            if share_with is None:
                words = [self._name_word(), self._name_word()]
            else:
                kept = share_with.split()
                position = self.rng.randrange(2)
                words = [kept[0], self._name_word()] if position == 0 else [self._name_word(), kept[1]]
            key = frozenset(words)
            if self.short_names and len({syllable for w in words for syllable in self.syllables[w]}) < 4:
                continue
            if len(key) == 2 and key not in self.used_words:
                self.used_words.add(key)
                return " ".join(words)

    def year(self, avoid: int | None = None) -> int:
        while True:
            year = self.rng.randint(1900, 2020)
            if year != avoid:
                return year

    def _write(self, name: str, kind: str, fact: str) -> None:
        sentences = [fact]
        if self.rng.random() < self.filler_prob:
            sentences.append(" " + FILLERS[kind].format(city=self.rng.choice(self.cities)))
        self.passages[name] = sentences

    def film(self, name: str, year: int | None = None, director: str | None = None) -> dict[str, Any]:
        fact = {"year": year or self.year(), "director": director or self.name()}
        self._write(name, "film", FILM_FACT.format(name=name, **fact))
        return fact

    def company(self, name: str, year: int | None = None, founder: str | None = None) -> dict[str, Any]:
        fact = {"year": year or self.year(), "founder": founder or self.name()}
        self._write(name, "company", COMPANY_FACT.format(name=name, **fact))
        return fact

    def person(self, name: str, city: str | None = None, occupation: str | None = None) -> dict[str, Any]:
        fact = {"city": city or self.rng.choice(self.cities), "occupation": occupation or self.rng.choice(OCCUPATIONS)}
        article = "an" if fact["occupation"][0] in "aeiou" else "a"
        self._write(name, "person", PERSON_FACT.format(name=name, article=article, **fact))
        return fact

    def entity(self, kind: str, name: str) -> dict[str, Any]:
        return {"film": self.film, "company": self.company, "person": self.person}[kind](name)

    def question(self, template: str) -> tuple[str, str, list[tuple[str, str]]]:
        """Returns the question, its answer and its gold passages as `(title, kind)`, writing those passages."""
        if template in LOOKUP_TEMPLATES:
            kind, name = QUESTION_ENTITY_KIND[template], self.name()
            facts = self.entity(kind, name)
            answer = facts[LOOKUP_ANSWER_FIELD[template]]
            return QUESTION_TEMPLATES[template][1].format(a=name), answer, [(name, kind)]
        if template in ("director_birthplace", "director_occupation", "founder_birthplace"):
            kind = "company" if template == "founder_birthplace" else "film"
            head, person = self.name(), self.name()
            if kind == "film":
                self.film(head, director=person)
            else:
                self.company(head, founder=person)
            facts = self.person(person)
            answer = facts["occupation"] if template == "director_occupation" else facts["city"]
            return QUESTION_TEMPLATES[template][1].format(a=head), answer, [(head, kind), (person, "person")]
        a, b = self.name(), self.name()
        if template == "same_birthplace":
            city_a = self.rng.choice(self.cities)
            city_b = city_a if self.rng.random() < 0.5 else self.rng.choice(self.cities)
            self.person(a, city=city_a)
            self.person(b, city=city_b)
            answer, kind = ("yes" if city_a == city_b else "no"), "person"
        else:
            kind = "company" if template == "founded_first" else "film"
            year_a = self.year()
            year_b = self.year(avoid=year_a)
            (self.company if kind == "company" else self.film)(a, year=year_a)
            (self.company if kind == "company" else self.film)(b, year=year_b)
            earlier, later = (a, b) if year_a < year_b else (b, a)
            answer = earlier if template == "founded_first" else later
        return QUESTION_TEMPLATES[template][1].format(a=a, b=b), answer, [(a, kind), (b, kind)]


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector: a large world is millions of small acyclic lists and dicts, whose building
    would trigger collections that find nothing to free (docs/design.md, "The offline lab")."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def make_synthetic_world(
    num_questions: int,
    seed: int = 0,
    num_distractors: int | None = None,
    comparison_fraction: float = 0.4,
    context_size: int = 10,
    filler_prob: float = 0.3,
    num_cities: int | None = None,
    lookup_fraction: float = 0.0,
    short_names: bool = False,
) -> SyntheticWorld:
    """
    Make a seeded synthetic world of multi-hop questions and the passages that answer them.

    Args:
        num_questions (`int`):
            Number of questions (records), from a few to hundreds of thousands.
        seed (`int`, *optional*, defaults to `0`):
            Same seed and arguments, identical world.
        num_distractors (`int`, *optional*):
            Distractor passages written for each question: entities of the same kind as a gold passage's, whose name
            shares one word with it. Defaults to one per gold passage (2).
        comparison_fraction (`float`, *optional*, defaults to `0.4`):
            Fraction of comparison questions; the rest are bridge questions.
        context_size (`int`, *optional*, defaults to `10`):
            Paragraphs in each record's `context` (HotpotQA's distractor setting has 10): the 2 gold passages, the
            question's distractors, then passages drawn from the rest of the world.
        filler_prob (`float`, *optional*, defaults to `0.3`):
            Probability that a passage has a second, filler sentence after its fact.
        num_cities (`int`, *optional*):
            Number of distinct city names; defaults to `min(2000, max(20, num_questions // 4))`.
        lookup_fraction (`float`, *optional*, defaults to `0.0`):
            Fraction of single-hop lookups (`"Who directed A?"`, `"Where was A born?"`, ...: one passage answers
            them, record `type` `"lookup"`), e.g. as the sub-questions of multi-objective tasks; the rest are bridge
            and comparison questions as `comparison_fraction` says. At 0 no random draw is spent on it.
        short_names (`bool`, *optional*, defaults to `False`):
            Build names and cities from two-syllable words only, with no syllable repeated within a name
            (`"Kalo Venu"`, never `"Kalo Lomi"` or `"Kalodor Venu"`), so that each token of a name follows a distinct
            one. Cities then default to at most 300 names.

    Returns:
        `SyntheticWorld`: records in HotpotQA's layout and the corpus of all passages. A record's `supporting_facts`
        are its gold passages' first sentences (two, the first hop first for a bridge question; one for a lookup);
        its `level` is `"hard"` when the question has distractor passages and `"easy"` otherwise.
    """
    if not isinstance(num_questions, int) or num_questions < 1:
        raise ValueError(f"`num_questions` must be a positive int, got {num_questions!r}.")
    if num_distractors is not None and num_distractors < 0:
        raise ValueError(f"`num_distractors` must be None or >= 0, got {num_distractors}.")
    if not 0.0 <= comparison_fraction <= 1.0:
        raise ValueError(f"`comparison_fraction` must be in [0, 1], got {comparison_fraction}.")
    if not 0.0 <= lookup_fraction <= 1.0:
        raise ValueError(f"`lookup_fraction` must be in [0, 1], got {lookup_fraction}.")
    if context_size < 2:
        raise ValueError(f"`context_size` must be >= 2 (the two gold passages), got {context_size}.")
    if not 0.0 <= filler_prob <= 1.0:
        raise ValueError(f"`filler_prob` must be in [0, 1], got {filler_prob}.")
    num_distractors = 2 if num_distractors is None else num_distractors
    num_cities = num_cities or min(300 if short_names else 2000, max(20, num_questions // 4))
    with _gc_paused():
        return _build_world(
            num_questions, seed, num_distractors, comparison_fraction, context_size, filler_prob, num_cities,
            lookup_fraction, short_names,
        )


def _build_world(
    num_questions: int,
    seed: int,
    num_distractors: int,
    comparison_fraction: float,
    context_size: int,
    filler_prob: float,
    num_cities: int,
    lookup_fraction: float,
    short_names: bool,
) -> SyntheticWorld:
    rng = random.Random(seed)
    builder = _WorldBuilder(rng, num_cities, filler_prob, short_names)

    questions = []  # (question, answer, type, gold [(title, kind)], distractor titles)
    for _ in range(num_questions):
        if lookup_fraction > 0 and rng.random() < lookup_fraction:  # no draw at 0
            template = rng.choice(LOOKUP_TEMPLATES)
        else:
            is_comparison = rng.random() < comparison_fraction
            template = rng.choice(COMPARISON_TEMPLATES if is_comparison else BRIDGE_TEMPLATES)
        question, answer, gold = builder.question(template)
        distractors = []
        for i in range(num_distractors):
            title, kind = gold[i % len(gold)]
            name = builder.name(share_with=title)
            builder.entity(kind, name)
            distractors.append(name)
        questions.append((question, answer, QUESTION_TEMPLATES[template][0], gold, distractors))

    titles = list(builder.passages)
    records, ids = [], set()
    for question, answer, qtype, gold, distractors in questions:
        context_titles = [title for title, _ in gold] + distractors[: max(0, context_size - len(gold))]
        chosen = set(context_titles)
        for _ in range(4 * context_size):  # draw the rest of the context from the world (fewer if it is tiny)
            if len(context_titles) >= min(context_size, len(titles)):
                break
            title = titles[rng.randrange(len(titles))]
            if title not in chosen:
                chosen.add(title)
                context_titles.append(title)
        rng.shuffle(context_titles)
        record_id = f"{rng.getrandbits(96):024x}"
        while record_id in ids:
            record_id = f"{rng.getrandbits(96):024x}"
        ids.add(record_id)
        records.append(
            {
                "_id": record_id,
                "answer": answer,
                "question": question,
                "supporting_facts": [[title, 0] for title, _ in gold],
                "context": [[title, list(builder.passages[title])] for title in context_titles],
                "type": qtype,
                "level": "hard" if distractors else "easy",
            }
        )
    corpus = [{"title": title, "text": "".join(sentences)} for title, sentences in builder.passages.items()]
    meta = {
        "num_questions": num_questions,
        "num_distractors": num_distractors,
        "comparison_fraction": comparison_fraction,
        "context_size": context_size,
        "filler_prob": filler_prob,
        "num_cities": num_cities,
    }
    if lookup_fraction > 0:
        meta["lookup_fraction"] = lookup_fraction
    if short_names:
        meta["short_names"] = True
    return SyntheticWorld(records=records, corpus=corpus, seed=seed, meta=meta)
