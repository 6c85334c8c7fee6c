"""vLLM's offline API: ``LLM(model).generate(prompts, sampling_params)``, plus ``chat`` and
``classify``."""

from __future__ import annotations

from typing import Optional, Sequence, Union

from weir.engine.engine_args import EngineArgs
from weir.engine.llm_engine import LLMEngine
from weir.engine.outputs import ClassificationOutput, RequestOutput, calibrate
from weir.engine.sampling_params import SamplingParams
from weir.model_source import PromptType, is_single_prompt, prompt_text


class LLM:
    """An engine for offline batches.

    Args:
        model: GGUF file, local Hugging Face folder, or None for the packaged SmolLM2-135M-Instruct.
        **engine_args: any field of :class:`weir.engine.engine_args.EngineArgs` (vLLM's names:
            ``dtype``, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``,
            ``block_size``, ``gpu_memory_utilization``, ``enable_prefix_caching``, ``load_format``...).

    Raises:
        FileNotFoundError: the model path does not exist.
        ValueError: an engine argument is out of range, or ``max_model_len`` does not fit the cache.
    """

    def __init__(self, model=None, **engine_args):
        self.llm_engine = LLMEngine(EngineArgs(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm_engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.llm_engine.model_name

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    @property
    def stat_loggers(self) -> list:
        """The engine's stat loggers (``LLMEngine.stat_loggers``)."""
        return self.llm_engine.stat_loggers

    @property
    def processor(self):
        """The engine's :class:`weir.engine.input_processor.InputProcessor`."""
        return self.llm_engine.processor

    def encode_prompt(self, prompt: PromptType) -> list[int]:
        """Token ids of a prompt: a string (tokenized with the model's special tokens), a list of
        token ids, chat messages (``[{"role": ..., "content": ...}]``, rendered with the
        tokenizer's chat template and a generation prompt), or one of vLLM's prompt dicts
        (``{"prompt": "..."}``, ``{"prompt_token_ids": [...]}``); see
        :func:`weir.model_source.encode_prompt`, which the client's length check shares.

        Raises:
            ValueError: the prompt is malformed, empty or longer than ``max_model_len`` allows.
        """
        return self.processor.encode_prompt(prompt)

    def encode_label(self, label: str, append_eos: bool = True) -> list[int]:
        """Token ids of a label as an answer (:meth:`InputProcessor.encode_label`)."""
        return self.processor.encode_label(label, append_eos)

    def _run(self, ids: list[str], use_tqdm: bool = False) -> list:
        """Step until every request in ``ids`` finished; their outputs in that order.

        Args:
            use_tqdm: show a progress bar of finished requests (vLLM's ``use_tqdm``).

        Raises:
            EngineStepError: a step failed; the batch's other requests are aborted too, so the
                engine is left with nothing of this call queued.
        """
        pending = set(ids)
        results = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", unit="prompt")
        try:
            while pending:
                for out in self.llm_engine.step():
                    if out.request_id in pending:
                        results[out.request_id] = out
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for rid in pending:
                self.llm_engine.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    @staticmethod
    def _params_per_prompt(sampling_params, num_prompts: int) -> list[SamplingParams]:
        """One :class:`SamplingParams` per prompt (default ``SamplingParams()``).

        Raises:
            TypeError: an entry is not a ``SamplingParams``.
            ValueError: a list whose length is not the number of prompts.
        """
        params = SamplingParams() if sampling_params is None else sampling_params
        params = list(params) if isinstance(params, (list, tuple)) else [params] * num_prompts
        for sp in params:
            if not isinstance(sp, SamplingParams):
                raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(sp).__name__}")
        if len(params) != num_prompts:
            raise ValueError(f"got {len(params)} sampling_params for {num_prompts} prompts")
        return params

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
                 use_tqdm: bool = False, priority: Optional[list[int]] = None) -> list[RequestOutput]:
        """Generate a continuation for each prompt, all batched together.

        Args:
            prompts: one prompt or a list (strings, token-id lists, chat message lists, vLLM
                prompt dicts).
            sampling_params: one for all prompts or one per prompt; default ``SamplingParams()``.
            use_tqdm: show a progress bar of finished prompts.
            priority: one per prompt, with ``scheduling_policy="priority"`` (lower first), as vLLM's.

        Returns:
            One :class:`RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a prompt is empty or too long, or a sampling parameter is out of range
                for this engine (checked for every prompt before any is queued).
            TypeError: ``prompts`` or ``sampling_params`` of another type.
            EngineStepError: a step failed (nothing of this call is left queued).
        """
        if is_single_prompt(prompts):
            prompts = [prompts]
        params = self._params_per_prompt(sampling_params, len(prompts))
        if priority is None:
            priority = [0] * len(prompts)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        encoded = [self.encode_prompt(p) for p in prompts]
        for e, sp, pr in zip(encoded, params, priority):
            self.llm_engine.check_request(e, sp)
            self.llm_engine.check_priority(pr)
        ids = [self.llm_engine.add_request(e, sp, prompt=prompt_text(p), priority=pr)
               for e, sp, p, pr in zip(encoded, params, prompts, priority)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: Union[list[dict], list[list[dict]]],
             sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the tokenizer's chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        return self.generate(list(messages), sampling_params, use_tqdm)

    def encode_labels(self, labels: list[str], label_texts: Optional[list[str]] = None) -> list[list[int]]:
        """Token ids scored for each label (:meth:`InputProcessor.encode_labels`).

        Raises:
            TypeError: ``labels`` or ``label_texts`` is not a list of strings.
            ValueError: empty label list, or ``label_texts`` of another length.
        """
        return self.processor.encode_labels(labels, label_texts)

    def classify(self, prompts: Union[PromptType, Sequence[PromptType]], labels: list[str],
                 label_texts: Optional[list[str]] = None,
                 calibration_prompt: Optional[PromptType] = None,
                 length_normalize: bool = False, use_tqdm: bool = False) -> list[ClassificationOutput]:
        """Score every label as a continuation of each prompt (choice scoring).

        Args:
            prompts: one prompt or a list (strings, token ids, chat messages).
            labels: the label names returned.
            label_texts: what is scored for each label (default: label + EOS).
            calibration_prompt: a content-free prompt in the same format (``"N/A"`` in place of
                the input); when given, scores are calibrated against it (:func:`weir.engine.outputs.calibrate`).
            length_normalize: score each label by its mean token log-probability instead of the sum.
            use_tqdm: show a progress bar of finished prompts.

        Returns:
            One :class:`ClassificationOutput` per prompt: the best label and every label's
            probability, in input order.

        Raises:
            ValueError: empty, blank or duplicate labels, empty or too long prompt (checked for
                every prompt before any is queued).
            EngineStepError: a step failed (nothing of this call is left queued).
        """
        if is_single_prompt(prompts):
            prompts = [prompts]
        if any(not isinstance(lab, str) or not lab.strip() for lab in labels):
            raise ValueError("labels must be non-blank strings")
        label_ids = self.encode_labels(labels, label_texts)
        encoded = [self.encode_prompt(p) for p in prompts]
        cal = None if calibration_prompt is None else self.encode_prompt(calibration_prompt)
        for e in encoded + ([cal] if cal is not None else []):
            self.llm_engine.check_classification(e, labels, label_ids)
        prior = None
        if cal is not None:
            prior = self._run([self.llm_engine.add_classification(cal, labels, label_ids,
                                                                  length_normalize=length_normalize)])[0]
        ids = [self.llm_engine.add_classification(e, labels, label_ids, length_normalize=length_normalize)
               for e in encoded]
        outs = self._run(ids, use_tqdm)
        return [calibrate(o, prior) for o in outs] if prior is not None else outs

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block (for cold-cache measurements). False while requests run."""
        return self.llm_engine.block_pool.reset_prefix_cache()

    def abort(self, request_id: str) -> bool:
        return self.llm_engine.abort(request_id)

    def stats(self) -> dict:
        return self.llm_engine.stats()
