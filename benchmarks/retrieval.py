"""Benchmark: BM25 retrieval over a synthetic world of about 100k passages, and the scripted expert on top of it.

Measures on CPU:

1. the time to build the synthetic world and the BM25 index (`BM25Retriever`, on `bm25s`);
2. single-query latency of `BM25Retriever.search` (p50 / p95 / mean over the expert's queries) and the throughput of
   `search_batch`;
3. retrieval quality: the fraction of the expert's queries whose gold passage (the passage about the entity it
   searched) is in the top 1 / 3 / 5, the expert's answer F1 through `HotpotQAEnv` (compact memory policy), and, for
   comparison, the recall of the gold passages a question names when the whole question is the query.

Usage:

```bash
python benchmarks/retrieval.py --num-passages 100000 --recall-questions 1000
python benchmarks/retrieval.py --write-docs   # also replaces the "Retrieval (BM25)" section of docs/benchmarks.md
```
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # the offline lab

from memopd_trl.envs.hotpot import HotpotQAEnv  # noqa: E402
from memopd_trl.envs.retrieval import BM25Retriever  # noqa: E402
from offline_lab import expert_trajectories, make_synthetic_world  # noqa: E402


SECTION = "## Retrieval (BM25)"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def recall_at(hits: list[list[dict]], golds: list[str], k: int) -> float:
    return sum(gold in {h["title"] for h in found[:k]} for found, gold in zip(hits, golds, strict=True)) / len(golds)


def run(args: argparse.Namespace) -> str:
    passages_per_question = 2 + args.num_distractors
    num_questions = max(1, args.num_passages // passages_per_question)
    start = time.perf_counter()
    world = make_synthetic_world(num_questions, seed=args.seed, num_distractors=args.num_distractors)
    world_s = time.perf_counter() - start
    start = time.perf_counter()
    retriever = BM25Retriever(world.corpus)
    index_s = time.perf_counter() - start
    print(f"world: {num_questions} questions, {len(world.corpus)} passages in {world_s:.1f} s; index {index_s:.1f} s")

    # The expert's episodes give the queries an agent really makes; each query starts with the searched entity's
    # two-word name, which is the title of its gold passage (retries append a word).
    records = world.records[: args.recall_questions]
    start = time.perf_counter()
    episodes = expert_trajectories(records, HotpotQAEnv.factory(retriever=retriever, top_k=args.env_top_k))
    play_s = time.perf_counter() - start
    queries = [q for e in episodes for q in e.queries]
    golds = [" ".join(q.split()[:2]) for q in queries]
    hits = retriever.search_batch(queries, top_k=5)
    recalls = {k: recall_at(hits, golds, k) for k in (1, 3, 5)}
    mean_f1 = statistics.mean(e.f1 for e in episodes)

    question_queries = [r["question"] for r in records]
    question_hits = retriever.search_batch(question_queries, top_k=5)
    # Gold passages a question names (both for a comparison, the first hop of a bridge question) and those it does
    # not name (the second hop of a bridge question, about an entity named only in the first passage).
    named, unnamed = [], []
    for record, found in zip(records, question_hits, strict=True):
        titles = {h["title"] for h in found}
        for title, _ in record["supporting_facts"]:
            (named if title in record["question"] else unnamed).append(title in titles)
    question_recall = (statistics.mean(named), statistics.mean(unnamed) if unnamed else float("nan"))

    timed = (queries * (args.num_queries // max(1, len(queries)) + 1))[: args.num_queries]
    for query in timed[:20]:  # warm-up
        retriever.search(query, top_k=args.env_top_k)
    latencies = []
    for query in timed:
        start = time.perf_counter()
        retriever.search(query, top_k=args.env_top_k)
        latencies.append((time.perf_counter() - start) * 1e3)
    start = time.perf_counter()
    for i in range(0, len(timed), args.batch_size):
        retriever.search_batch(timed[i : i + args.batch_size], top_k=args.env_top_k)
    batch_qps = len(timed) / (time.perf_counter() - start)
    # The same queries through bm25s' own `retrieve` (top-k by a partition of all scores), for comparison.
    library_queries = timed[: args.num_library_queries]
    token_ids = retriever._tokenizer.tokenize(
        library_queries, update_vocab=False, return_as="ids", show_progress=False
    )
    start = time.perf_counter()
    retriever._bm25.retrieve(token_ids, k=args.env_top_k, show_progress=False)
    library_ms = (time.perf_counter() - start) * 1e3 / max(1, len(library_queries))

    big_world_s, num_passages = None, len(world.corpus)
    if args.big_world_questions:
        del world, episodes, retriever  # free memory before the big build
        start = time.perf_counter()
        big = make_synthetic_world(args.big_world_questions, seed=args.seed, num_distractors=args.num_distractors)
        big_world_s, big_passages = time.perf_counter() - start, len(big.corpus)
        del big

    command = "python benchmarks/retrieval.py " + " ".join(sys.argv[1:])
    machine = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), Python {platform.python_version()}"
    lines = [
        SECTION,
        "",
        f"Command: `{command.strip()}` on {machine}, a shared machine (other jobs were running; times are indicative).",
        "",
        f"Synthetic world (seed {args.seed}): {num_questions} questions, {num_passages} passages "
        f"({args.num_distractors} distractor passages per question, each sharing a name word with a gold passage).",
        "",
        "| measurement | value |",
        "| --- | --- |",
        f"| build the world | {world_s:.1f} s |",
        f"| build the BM25 index (`BM25Retriever`, bm25s, numpy backend) | {index_s:.1f} s |",
        f"| `search` latency, top {args.env_top_k}, p50 / p95 / mean ({len(timed)} queries) | "
        f"{percentile(latencies, 0.5):.2f} / {percentile(latencies, 0.95):.2f} / {statistics.mean(latencies):.2f} ms |",
        f"| `search_batch` throughput (batches of {args.batch_size}) | {batch_qps:.0f} queries/s |",
        f"| for comparison: bm25s `BM25.retrieve`, mean per query ({len(library_queries)} queries) | "
        f"{library_ms:.2f} ms |",
        f"| expert queries with the gold passage in the top 1 / 3 / 5 ({len(queries)} queries) | "
        f"{recalls[1]:.3f} / {recalls[3]:.3f} / **{recalls[5]:.3f}** |",
        f"| expert answer F1 through `HotpotQAEnv` (compact, top {args.env_top_k}), {len(records)} questions | "
        f"**{mean_f1:.3f}** ({play_s:.1f} s) |",
        f"| whole question as the query: gold passages in the top 5, named in it / second hop of a bridge | "
        f"{question_recall[0]:.3f} / {question_recall[1]:.3f} |",
        *(
            [f"| build a {args.big_world_questions}-question world ({big_passages} passages) | {big_world_s:.1f} s |"]
            if big_world_s is not None
            else []
        ),
        "",
        "`BM25Retriever` scores with bm25s but selects the top k itself, among the passages with a positive score: "
        "bm25s' `retrieve` partitions the whole score array, which numpy does slowly when almost every score ties at "
        "0 (the comparison row).",
        "",
        "The expert searches entity names, so its recall is what an agent that names the right entity gets. The "
        "last line shows why an agent must search twice: the passage holding a bridge question's answer is about an "
        "entity the question does not name, and a search with the question does not bring it back.",
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace (or append) this benchmark's section of `path`, leaving every other section as it is."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION + "\n")
    if start == -1:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = text.find("\n## ", start + len(SECTION))
        text = text[:start] + section + (text[end + 1 :] if end != -1 else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text.rstrip("\n") + "\n", encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-passages", type=int, default=100_000, help="Approximate size of the corpus.")
    parser.add_argument("--num-distractors", type=int, default=2, help="Distractor passages per question.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the synthetic world.")
    parser.add_argument("--recall-questions", type=int, default=1000, help="Questions the expert plays for recall.")
    parser.add_argument("--num-queries", type=int, default=2000, help="Queries timed for latency and throughput.")
    parser.add_argument("--batch-size", type=int, default=256, help="Queries per `search_batch` call.")
    parser.add_argument("--num-library-queries", type=int, default=300, help="Queries timed through bm25s' retrieve.")
    parser.add_argument(
        "--big-world-questions", type=int, default=100_000, help="Also time building a world this large (0: skip)."
    )
    parser.add_argument("--env-top-k", type=int, default=3, help="Passages per search in the environment.")
    parser.add_argument("--write-docs", action="store_true", help=f"Replace '{SECTION}' in docs/benchmarks.md.")
    args = parser.parse_args()
    section = run(args)
    print(section)
    if args.write_docs:
        write_section(DOCS, section)
        print(f"wrote {SECTION!r} to {DOCS}")


if __name__ == "__main__":
    main()
