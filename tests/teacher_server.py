"""
A teacher server for tests: the endpoints of vLLM's OpenAI-compatible server that a `ServerTeacher` calls
(`/v1/models`, `/tokenize`, `/detokenize`, `/v1/completions` with `prompt_logprobs`), answered in vLLM's format by a
real local model's forward in float32, on 127.0.0.1. It records what it receives and can be told to fail, so that
the client's checks and retries can be tested without vLLM; tests/test_vllm_server.py runs the real server.
"""

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


class TeacherServer:
    """
    Args:
        model: the teacher (a transformers causal LM), scored in float32.
        tokenizer: the tokenizer the server reports (`/tokenize`, `/detokenize`).
        extra_tokens (`int`): ids past the tokenizer's that `/detokenize` pretends to know (a larger vocabulary).

    Attributes a test sets or reads:
        fail_next (`int`): the next this many `/v1/completions` requests answer HTTP 503.
        corrupt (`str` or `None`): `"short"` drops the last prompt position, `"missing"` empties one action
            position, `"nan"` puts NaN in a top log-prob (every later `/v1/completions` answer).
        received (`list[list[int]]`): every sequence sent to `/v1/completions`, in order.
        completions_requests (`int`): `/v1/completions` requests received (failed ones included).
    """

    def __init__(self, model, tokenizer, extra_tokens: int = 0, max_model_len: int = 4096):
        self.model = model.float().eval()
        self.tokenizer = tokenizer
        self.extra_tokens = extra_tokens
        self.max_model_len = max_model_len
        self.fail_next = 0
        self.corrupt = None
        self.received: list[list[int]] = []
        self.completions_requests = 0
        self.lock = threading.Lock()

    # -- vLLM's answers ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def prompt_logprobs(self, ids: list[int], k: int) -> list:
        log_probs = self.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # (L, V)
        positions = [None]
        for p in range(1, len(ids)):
            dist = log_probs[p - 1]
            top = dist.topk(k)
            ranks = (dist > dist[ids[p]]).sum().item() + 1
            entry = {
                str(t): {"logprob": v, "rank": r, "decoded_token": self.tokenizer.decode([t])}
                for r, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), start=1)
            }
            entry.setdefault(str(ids[p]), {"logprob": dist[ids[p]].item(), "rank": ranks, "decoded_token": ""})
            positions.append(entry)
        return positions

    def answer(self, path: str, body: dict) -> tuple[int, dict]:
        name = "teacher"
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": name, "max_model_len": self.max_model_len}]}
        if path == "/tokenize":
            ids = self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))["input_ids"]
            return 200, {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}
        if path == "/detokenize":
            ids = body["tokens"]
            known = [t for t in ids if t < len(self.tokenizer)]
            text = self.tokenizer.decode(known) + "x" * sum(
                len(self.tokenizer) <= t < len(self.tokenizer) + self.extra_tokens for t in ids
            )
            return 200, {"prompt": text}
        if path == "/v1/completions":
            with self.lock:
                self.completions_requests += 1
                if self.fail_next > 0:
                    self.fail_next -= 1
                    return 503, {"error": "overloaded"}
                prompts = body["prompt"]
                self.received.extend(prompts)
            choices = []
            for i, ids in enumerate(prompts):
                positions = self.prompt_logprobs(ids, body["prompt_logprobs"])
                if self.corrupt == "short":
                    positions = positions[:-1]
                elif self.corrupt == "missing":
                    positions[-1] = None
                elif self.corrupt == "nan":
                    first = next(iter(positions[-1]))
                    positions[-1][first]["logprob"] = float("nan")
                choices.append({"index": i, "text": "", "prompt_logprobs": positions, "finish_reason": "length"})
            return 200, {"id": "cmpl", "object": "text_completion", "choices": choices}
        return 404, {"error": f"no route {path}"}


@contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]):
    """Serves `handler` on 127.0.0.1 (a free port) in a thread for the duration; yields the URL. Always stopped."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


@contextmanager
def serve_teacher(model, tokenizer, **kwargs):
    """Runs a `TeacherServer` on 127.0.0.1 (a free port) for the duration; yields `(server, url)`. Always stopped."""
    server = TeacherServer(model, tokenizer, **kwargs)

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802 (http.server's name)
            self._reply(*server.answer(self.path, {}))

        def do_POST(self):  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            self._reply(*server.answer(self.path, body))

        def log_message(self, *args):  # quiet
            pass

    with _serving(Handler) as url:
        yield server, url


@contextmanager
def recording_proxy(target: str):
    """
    A pass-through to the server at `target` on 127.0.0.1 that records every sequence sent to `/v1/completions`
    (what the real server received). Yields `(received, url)`; always stopped.
    """
    import urllib.request

    received: list[list[int]] = []

    class Handler(BaseHTTPRequestHandler):
        def _forward(self, body: bytes | None) -> None:
            request = urllib.request.Request(target + self.path, data=body, method=self.command)
            request.add_header("Content-Type", "application/json")
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    status, data = response.status, response.read()
            except urllib.error.HTTPError as error:
                status, data = error.code, error.read()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._forward(None)

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/completions":
                received.extend(json.loads(body)["prompt"])
            self._forward(body)

        def log_message(self, *args):
            pass

    with _serving(Handler) as url:
        yield received, url
