"""Benchmark: what a teacher server's automatic prefix caching saves when it scores a memory agent's invocations.

A local teacher scores packed rows in which invocations that share a prefix (the `num_generations` episodes of a
question share their first context) are encoded once (shared-prefix packing). A teacher on vLLM's server is sent
every invocation as its own sequence; its automatic prefix caching can stand in for that sharing. This plays real
HotpotQA episodes with SmolLM2-135M-Instruct (`--checkpoint`, float32), starts vLLM's OpenAI server on it twice (prefix
caching on, then off), scores the same invocations through `ServerTeacher` on each and reports the seconds. It
compares with the share of tokens shared-prefix packing saves on the same invocations, and with a local teacher's
packed forward of them (plain and shared-prefix packing, the same checkpoint, fp32, top-k read from its LM head).

    python benchmarks/teacher_server.py --checkpoint CKPT --dataset ../shared/data/hotpotqa_dev_distractor_sample.json

Run it in vLLM's environment (the server's Python is this one). Numbers: docs/benchmarks.md ("A teacher on its own
server: what prefix caching saves").
"""

import argparse
import json
import os
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
from memopd_trl.attention import (
    VARLEN_SDPA,  # noqa: E402
    register_varlen_attention,  # noqa: E402
)
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


def local_seconds(model, tokenizer, invocations, top_k: int, share_prefix: bool, repeats: int) -> float:
    """The best of `repeats` local teacher scorings (packed forward, top-k from the LM head), in seconds."""
    from accelerate import Accelerator

    from memopd_trl.teacher import LocalTeacher

    register_varlen_attention()
    model.config._attn_implementation = VARLEN_SDPA
    pad = tokenizer.pad_token_id
    collator = PackedInvocationCollator(max_model_length=8192, pad_token_id=pad, share_prefix=share_prefix)
    teacher = LocalTeacher(
        model, Accelerator(cpu=True), {"aligned": collator}, pad,
        len(tokenizer), 1.0, 1024, top_k=top_k,
    )  # fmt: skip
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        teacher.score(invocations)
        best = min(best, time.perf_counter() - start)
    return best


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
    saved = int(packed.get("num_tokens_saved", 0))
    shared = saved / (int(packed["num_real_tokens"]) + saved)
    print(f"{len(invocations)} invocations, {tokens} tokens; shared-prefix packing skips {shared:.1%} of them")
    results = {"invocations": len(invocations), "tokens": tokens, "shared_prefix_packing_saves": shared, "servers": {}}
    for prefix_caching in (True, False):
        process, url = start_server(args.checkpoint, args.top_k, prefix_caching)
        try:
            teacher = ServerTeacher(url, tokenizer, args.top_k)
            runs = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                teacher.score(invocations)
                runs.append(time.perf_counter() - start)
                print(f"server, prefix caching {'on ' if prefix_caching else 'off'}: {runs[-1]:.2f} s")
            results["servers"]["on" if prefix_caching else "off"] = runs
        finally:
            stop(process)
    for share_prefix in (False, True):
        seconds = local_seconds(model, tokenizer, invocations, args.top_k, share_prefix, args.repeats)
        results[f"local_{'shared_prefix' if share_prefix else 'plain'}_packing"] = seconds
        print(f"local teacher, {'shared-prefix' if share_prefix else 'plain'} packing: {seconds:.2f} s")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
