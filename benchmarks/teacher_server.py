"""Benchmark: what a teacher server's automatic prefix caching saves when it scores a memory agent's invocations.

A local teacher scores packed rows in which invocations that share a prefix (the `num_generations` episodes of a
question share their first context) are encoded once (shared-prefix packing). A teacher on vLLM's server is sent
every invocation as its own sequence; its automatic prefix caching can stand in for that sharing. This plays real
HotpotQA episodes with SmolLM2-135M-Instruct (`--checkpoint`, float32), starts vLLM's OpenAI server on it twice (prefix
caching on, then off), scores the same invocations through `ServerTeacher` on each, and reports the seconds, the
prompt tokens the server computed, and its prefix-cache hit rate (`/metrics`). It compares with the share of tokens
shared-prefix packing saves on the same invocations.

    python benchmarks/teacher_server.py --checkpoint CKPT --dataset ../shared/data/hotpotqa_dev_distractor_sample.json

Run it in vLLM's environment (the server's Python is this one). Numbers: docs/benchmarks.md ("A teacher on its own
server: what prefix caching saves").
"""

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from memopd_trl import HotpotQAEnv, PackedInvocationCollator, RolloutEngine, load_hotpotqa  # noqa: E402
from memopd_trl.envs.retrieval import corpus_from_records  # noqa: E402
from memopd_trl.teacher import ServerTeacher  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="A float32 SmolLM2-135M-Instruct checkpoint directory.")
    parser.add_argument("--dataset", required=True, help="A local HotpotQA .json file.")
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--num_generations", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=48)
    parser.add_argument("--top_k", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3, help="Scorings per server (the first fills its cache).")
    parser.add_argument("--output", default=None, help="Write the results as JSON here.")
    return parser.parse_args()


def start_server(checkpoint: str, top_k: int, prefix_caching: bool) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint, "--dtype", "float32",
        "--max-logprobs", str(top_k), "--max-model-len", "2048", "--host", "127.0.0.1", "--port", str(port),
        "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}")
        try:
            if requests.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return process, url
        except requests.RequestException:
            pass
        time.sleep(2)
    raise RuntimeError("the server did not answer within 900 s")


def stop(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def counters(url: str) -> dict[str, float]:
    """The server's prompt-token and prefix-cache counters (Prometheus text at `/metrics`)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    found = {}
    for name in ("vllm:prompt_tokens_total", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        values = [float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} ([0-9.e+]+)$", text, re.M)]
        found[name.split(":")[1]] = sum(values)
    return found


def main() -> None:
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    records = load_hotpotqa(args.dataset)[: args.questions]
    env_factory = HotpotQAEnv.factory(corpus=corpus_from_records(records), top_k=1, max_turns=3, max_malformed=2)
    engine = RolloutEngine(model, tokenizer, env_factory, max_new_tokens=args.max_new_tokens, max_prompt_length=768)
    torch.manual_seed(0)
    episodes, _ = engine.rollout(records, num_generations=args.num_generations)
    invocations = [inv for ep in episodes for inv in ep.invocations]
    tokens = sum(inv.num_tokens for inv in invocations)
    packed = PackedInvocationCollator(pad_token_id=tokenizer.pad_token_id, share_prefix=True)(invocations)
    shared = float(packed.get("shared_fraction", 0.0))
    print(f"{len(invocations)} invocations, {tokens} tokens; shared-prefix packing skips {shared:.1%} of them")
    results = {"invocations": len(invocations), "tokens": tokens, "shared_prefix_packing_saves": shared, "servers": {}}
    for prefix_caching in (True, False):
        process, url = start_server(args.checkpoint, args.top_k, prefix_caching)
        try:
            teacher = ServerTeacher(url, tokenizer, args.top_k)
            runs = []
            for _ in range(args.repeats):
                before = counters(url)
                start = time.perf_counter()
                teacher.score(invocations)
                seconds = time.perf_counter() - start
                after = counters(url)
                delta = {key: after[key] - before[key] for key in after}
                hit_rate = delta["prefix_cache_hits_total"] / max(delta["prefix_cache_queries_total"], 1)
                runs.append({"seconds": seconds, "hit_rate": hit_rate, **delta})
                print(f"prefix caching {'on ' if prefix_caching else 'off'}: {seconds:.2f} s, prefix-cache hits "
                      f"{hit_rate:.1%} of {delta['prefix_cache_queries_total']:.0f} prompt tokens")  # fmt: skip
            results["servers"]["on" if prefix_caching else "off"] = runs
        finally:
            stop(process)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
