"""The lm-evaluation-harness model "farsight": loglikelihood, rolling loglikelihood and
generate_until on farsight's streaming Session, so a DRT scores contexts of any length.

    lm_eval.simple_evaluate(model="farsight", model_args="pretrained=DIR,memory=disk,dtype=bf16,batch_size=4", tasks=[...])

Requests whose contexts and continuations have the same token lengths are decoded together, up
to `batch_size` rows per session; every other request runs alone, so no row is ever padded. A
DRT scores log-likelihood requests per distinct context instead: the context is fed once and
each continuation is scored from it (the session rewinds), which a multiple-choice item with a
long context needs most.

A DRT's log-likelihoods are those of the stream from the context's first token, as training and
`forward` lay it out (so lm-eval's own model "hf" gives the same numbers); `align_context=true`
lays each context out to end on a chunk boundary instead, as a session's prefill aligns a prompt
(docs/design.md §2.1), for tasks whose question may fall at any offset. Generation always starts
from an aligned prompt, as `generate` does.
"""

from __future__ import annotations

import contextlib
import io
import random
import statistics
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from lm_eval.api.model import TemplateLM

from farsight.data.corpora import unreachable_hub_errors
from farsight.errors import InputError, MissingFileError
from farsight.hf.configuration import resolve_dtype
from farsight.models import (
    KV_DTYPES,
    MEMORY_TIERS,
    ContinuationScore,
    load_model,
    resolve_model_dir,
    sample_next_token,
    set_retrieval_neighbors,
    set_retrieval_top_k,
)
from farsight.models.registry import load_model_tokenizer
from farsight.ops.precision import widened_matmuls
from farsight.progress import progress_bar

DEFAULT_MAX_GEN_TOKS = 256


class FarsightLM(TemplateLM):
    """A farsight model directory as an lm-eval LM.

    pretrained: model or training-run directory; memory/kv_dtype: DRT's chunk-memory tier and
    stored K/V dtype; dtype: "fp32" (default), "bf16", "fp16"; batch_size: rows per session;
    device: where the model runs (default: cuda if available, else cpu); align_context: score a
    DRT's log-likelihoods with each context aligned to end on a chunk boundary (default false:
    the stream from the context's first token, as `forward` computes it); retrieval_top_k: the
    past chunks a DRT reads per chunk, instead of its own top_k (`set_retrieval_top_k`);
    retrieval_neighbors: the chunks it reads beside each, N or "BEFORE:AFTER"
    (`set_retrieval_neighbors`).
    """

    def __init__(
        self,
        pretrained: str,
        memory: str = "device",
        kv_dtype: str | None = None,
        dtype: str = "fp32",
        batch_size: int | str = 1,
        device: str | None = None,
        max_batch_size: int | None = None,
        align_context: bool | str = False,
        retrieval_top_k: int | str | None = None,
        retrieval_neighbors: int | str | tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if memory not in MEMORY_TIERS:
            raise InputError(f"memory={memory!r} is not a chunk-memory tier; choose one of {list(MEMORY_TIERS)}")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise InputError(f"kv_dtype={kv_dtype!r} is unknown; choose one of {list(KV_DTYPES)}")
        if not str(batch_size).isdigit() or int(batch_size) < 1:
            raise InputError(
                f"batch_size={batch_size!r} must be an integer >= 1 (farsight has no automatic batch size)"
            )
        self.align_context = _flag(align_context, "align_context")
        directory = resolve_model_dir(pretrained)
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load_model(directory, map_location=self._device).eval()
        torch_dtype = resolve_dtype(dtype)
        if torch_dtype is not None and torch_dtype != next(self.model.parameters()).dtype:
            self.model.to(torch_dtype)
        if retrieval_top_k is not None:
            set_retrieval_top_k(self.model, _whole_number(retrieval_top_k))
        if retrieval_neighbors is not None:
            set_retrieval_neighbors(self.model, retrieval_neighbors)
        self.tokenizer = load_model_tokenizer(directory, self.model.config.vocab_size)
        self.pretrained = str(directory)
        self.session_options = {"memory": memory, "kv_dtype": kv_dtype}
        self.batch_size = int(batch_size)

    # ---- what TemplateLM asks ------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return f"farsight-{self.tokenizer.kind}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of `string`; farsight's tokenizers never add special tokens."""
        return self.tokenizer.encode(string)

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """Per (context ids, continuation ids): the summed log-probability of the continuation and
        whether greedy decoding would have produced it."""
        pairs = [(context, continuation) for _, context, continuation in requests]
        with self._matmuls():
            results = self._score_pairs(pairs, disable_tqdm, "loglikelihood")
        for (texts, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", texts, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole document, its first token conditioned on eos (the
        separator farsight's corpora put between documents)."""
        pairs = []
        for request in requests:
            ids = self.tok_encode(request.args[0])
            pairs.append(([self.eot_token_id], ids) if ids else None)
        with self._matmuls():
            scored = iter(self._score_pairs([p for p in pairs if p is not None], disable_tqdm, "loglikelihood_rolling"))
        results = [next(scored)[0] if pair is not None else 0.0 for pair in pairs]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", (request.args[0],), result)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Continue each context (greedy unless gen_kwargs ask to sample) until one of the `until`
        strings, eos, or max_gen_toks tokens; the text is cut before the stop string."""
        groups: dict[tuple, list[int]] = defaultdict(list)
        prepared = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            ids = self.tok_encode(context) or [self.eot_token_id]
            options = generation_options(gen_kwargs)
            prepared.append((ids, options))
            groups[(len(ids), repr(sorted(options.items())))].append(index)
        results: list[str] = [""] * len(requests)
        progress = progress_bar(total=len(requests), desc="farsight generate_until", disable=disable_tqdm)
        for indices in groups.values():
            for batch in _batches(indices, self.batch_size):
                options = prepared[batch[0]][1]
                ids = torch.tensor([prepared[i][0] for i in batch], dtype=torch.long, device=self._device)
                with self._matmuls():
                    texts = self._generate(ids, options)
                for index, text in zip(batch, texts):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                progress.update(len(batch))
        progress.close()
        return results

    # ---- on the Session --------------------------------------------------------------------------
    def _matmuls(self):
        """Around model work: bf16/fp16 products that this device's CPU lacks run as fp32 GEMMs."""
        return widened_matmuls(self._device, next(self.model.parameters()).dtype)

    def _score_pairs(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool, what: str
    ) -> list[tuple[float, bool]]:
        """(log p(continuation | context) summed, greedy match) per (context, continuation) ids,
        sessions batching the pairs of equal lengths (DRT: one prefill per distinct context)."""
        if self.model.model_type == "drt":
            return self._score_by_context(pairs, disable_tqdm, what)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for index, (context, continuation) in enumerate(pairs):
            groups[(len(context), len(continuation))].append(index)
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        progress = progress_bar(total=len(pairs), desc=f"farsight {what}", disable=disable_tqdm)
        for indices in groups.values():
            for batch in _batches(indices, self.batch_size):
                context = torch.tensor([pairs[i][0] for i in batch], dtype=torch.long, device=self._device)  # [b, Tc]
                continuation = torch.tensor(
                    [pairs[i][1] for i in batch], dtype=torch.long, device=self._device
                )  # [b, Tn]
                for index, result in zip(batch, self._score(context, continuation)):
                    results[index] = result
                progress.update(len(batch))
        progress.close()
        return results

    def _score(self, context: torch.Tensor, continuation: torch.Tensor) -> list[tuple[float, bool]]:
        """context [b, Tc], continuation [b, Tn] -> per row (summed log-prob, greedy match)."""
        if continuation.shape[1] == 0:
            return [(0.0, True)] * context.shape[0]
        with self.model.new_session(context.shape[0], **self.session_options) as session:
            session.prefill(context)
            score = session.score_continuation(continuation)  # [b, Tn]
        return _totals(score)

    def _score_by_context(
        self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool, what: str
    ) -> list[tuple[float, bool]]:
        """DRT: every distinct context is fed once and its continuations are scored from it in
        turn (the session rewinds between them), so a multiple-choice item costs one prefill."""
        groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
        for index, (context, _) in enumerate(pairs):
            groups[tuple(context)].append(index)
        results: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        progress = progress_bar(total=len(pairs), desc=f"farsight {what}", disable=disable_tqdm)
        for context, indices in groups.items():
            scored = [i for i in indices if pairs[i][1]]
            with self.model.new_session(1, **self.session_options) as session:
                ids = torch.tensor([context], dtype=torch.long, device=self._device)  # [1, Tc]
                # a tensor prompt is aligned to end on a chunk boundary; blocks are fed as they are
                session.prefill(ids if self.align_context else iter([ids]))
                scores = session.score_each(
                    [torch.tensor([pairs[i][1]], dtype=torch.long, device=self._device) for i in scored]
                )
            for index, score in zip(scored, scores):
                results[index] = _totals(score)[0]
            progress.update(len(indices))
        progress.close()
        return results

    def _generate(self, ids: torch.Tensor, options: dict[str, Any]) -> list[str]:
        """Continue ids [b, T] in one session; per row, the text up to its first stop."""
        until, max_new = options["until"], options["max_gen_toks"]
        rows = ids.shape[0]
        new: list[list[int]] = [[] for _ in range(rows)]
        done = [max_new == 0] * rows
        with self.model.new_session(rows, **self.session_options) as session:
            logits = session.prefill(ids)  # [b, V]
            for step in range(max_new):
                token = sample_next_token(logits, options["temperature"], options["top_k"], options["top_p"])  # [b]
                for row, value in enumerate(token.tolist()):
                    if done[row]:
                        continue
                    if value == self.eot_token_id:
                        done[row] = True
                        continue
                    new[row].append(value)
                    done[row] = len(new[row]) == max_new or _stops(self.tok_decode(new[row]), until)
                if all(done) or step + 1 == max_new:
                    break
                logits = session.step(token)
        return [cut_at_stop(self.tok_decode(tokens), until) for tokens in new]


def _flag(value: bool | str, name: str) -> bool:
    """A boolean model argument, as Python or as lm-eval's model_args string gives it."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise InputError(f"{name}={value!r} must be true or false")


def _whole_number(value: int | str) -> int | str:
    """A whole-number model argument, as Python or as lm-eval's model_args string gives it ("2");
    anything else is returned as it is, for the consumer's own error."""
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _totals(score: ContinuationScore) -> list[tuple[float, bool]]:
    """Per row: the continuation's summed log-probability and whether greedy decoding gives all of it."""
    return [
        (float(total), bool(match))
        for total, match in zip(score.logprobs.sum(dim=1).tolist(), score.greedy.all(dim=1).tolist())
    ]


def generation_options(gen_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A task's generation_kwargs as farsight's sampling options (greedy unless do_sample or a
    temperature > 0 ask to sample); unknown keys are refused."""
    options = dict(gen_kwargs)
    until = options.pop("until", None) or []
    until = [until] if isinstance(until, str) else list(until)
    max_gen_toks = int(options.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
    temperature = float(options.pop("temperature", 0.0))
    do_sample = bool(options.pop("do_sample", temperature > 0))
    top_k, top_p = options.pop("top_k", None), options.pop("top_p", None)
    if options:
        raise InputError(
            f"generation_kwargs {sorted(options)} are not supported by farsight; use until, max_gen_toks, do_sample, temperature, top_k, top_p"
        )
    return {
        "until": until,
        "max_gen_toks": max_gen_toks,
        "temperature": (temperature or 1.0) if do_sample else 0.0,
        "top_k": int(top_k) if do_sample and top_k else None,
        "top_p": float(top_p) if do_sample and top_p is not None and float(top_p) < 1 else None,
    }


def _stops(text: str, until: list[str]) -> bool:
    return any(stop in text for stop in until)


def cut_at_stop(text: str, until: list[str]) -> str:
    """`text` up to the earliest occurrence of any stop string."""
    cut = min((text.find(stop) for stop in until if stop in text), default=len(text))
    return text[:cut]


def _batches(indices: list[int], size: int) -> Iterator[list[int]]:
    return (indices[start : start + size] for start in range(0, len(indices), size))


def task_manager(tasks: Sequence[str], include_path: str | None = None, metadata: dict[str, Any] | None = None) -> Any:
    """An lm-eval TaskManager that knows `tasks`: the tasks of `include_path` alone when they are
    all there (lm-eval's index of its ~15k built-in tasks takes seconds to build), else those and
    the built-in ones. `metadata` reaches every task's config and the generators of lm-eval's
    synthetic tasks (RULER's `max_seq_lengths` and `tokenizer`)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(task in local.all_tasks for task in tasks):
            return local
    return TaskManager(include_path=include_path, metadata=metadata)


# the few-shot example lm-eval's ruler_vt builds for every length, in tokens
RULER_VT_EXAMPLE_TOKENS = 500
# random draws of an item's smallest form that the check below measures
RULER_FIT_DRAWS = 8


def check_ruler_items_fit(tasks: Sequence[str], task_kwargs: dict[str, Any]) -> None:
    """Refuse (InputError, one line) lm-eval RULER tasks whose smallest items do not fit, with
    the tokenizer the tasks will use, before lm-eval spends the evaluation on them. `ruler_vt`
    shrinks its few-shot example until it fits in 500 tokens and retries forever when its
    smallest does not; `ruler_cwe` sizes its items by one draw of its smallest (10 words) and, when
    that exceeds the length, builds items with no words, which lm-eval fails to score after the
    whole run. A byte-level tokenizer never fits vt and needs about 7K tokens for cwe at 4K.
    `task_kwargs` is what the tasks receive (the tokenizer under `tokenizer` or `pretrained`, the
    lengths under `max_seq_lengths`); `ruler` is the group of both."""
    wanted = set(tasks)
    vt, cwe = bool(wanted & {"ruler", "ruler_vt"}), bool(wanted & {"ruler", "ruler_cwe"})
    if not (vt or cwe):
        return
    from lm_eval.tasks.ruler import common_utils, cwe_utils, vt_utils

    tokenizer = common_utils.get_tokenizer(common_utils.resolve_tokenizer_name(task_kwargs))
    lengths = task_kwargs.get("max_seq_lengths", common_utils.DEFAULT_SEQ_LENGTHS)

    def tokens(text: str) -> int:
        return len(tokenizer(text).input_ids)

    def cwe_tokens(length: int) -> int:
        example, item, answer = cwe_utils.generate_input_output(10, length)
        return tokens(example + "\n" + item + " " + " ".join(f"{i + 1}. {word}" for i, word in enumerate(answer)))

    # the generators draw from the global random states: leave them as they were
    random_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # vt_utils prints as it shrinks
            # vt's smallest example: one chain of 4 hops in 5 noise lines; lm-eval retries until one fits
            vt_need = (
                min(tokens(vt_utils.generate_input_output(5, 1, 4, is_icl=True)[0]) for _ in range(RULER_FIT_DRAWS))
                + vt_utils.CONFIG["variable_tracking"]["tokens_to_generate"]
                if vt
                else 0
            )
            # cwe sizes its items by one draw of its 10-word item with its few-shot example and
            # the answer as lm-eval measures it, and the tokens it leaves to generate
            cwe_need = (
                {
                    length: statistics.median(cwe_tokens(length) for _ in range(RULER_FIT_DRAWS))
                    + cwe_utils.CONFIG["tokens_to_generate"]
                    for length in lengths
                }
                if cwe
                else {}
            )
    finally:
        random.setstate(random_state)
        np.random.set_state(numpy_state)
    if vt_need > RULER_VT_EXAMPLE_TOKENS:
        raise InputError(
            f"lm-eval's ruler_vt cannot build its items with this tokenizer: its few-shot example takes {vt_need} "
            f"tokens at its smallest, over the {RULER_VT_EXAMPLE_TOKENS} lm-eval builds it in (it would retry "
            "forever); leave ruler_vt out, or name a tokenizer with more characters a token in --metadata"
        )
    for length, need in cwe_need.items():
        if need > length:
            raise InputError(
                f"lm-eval's ruler_cwe cannot build items of {length} tokens with this tokenizer: its smallest takes "
                f"about {need:.0f} (lm-eval would build them with no words and fail to score them); leave it out "
                "at that length"
            )


class _TolerantLoader(yaml.SafeLoader):
    """Safe YAML that reads lm-eval's `!function NAME` tags as plain strings (nothing is imported)."""


_TolerantLoader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node))


def check_task_data(include_path: str, tasks: Sequence[str]) -> None:
    """Refuse (MissingFileError, one line) a task of `include_path` named in `tasks` (by its name
    or a tag) whose data file does not exist, before lm-eval fails on it with a traceback. A
    relative path is read as lm-eval reads it: from the working directory, or from the YAML's
    folder for the tasks farsight exports (they load their items through farsight_data.py)."""
    wanted = set(tasks)
    for path in sorted(Path(include_path).rglob("*.y*ml")):
        try:
            config = yaml.load(path.read_text(encoding="utf-8"), Loader=_TolerantLoader)
        except (yaml.YAMLError, UnicodeDecodeError, OSError):
            continue  # lm-eval reports the YAML itself
        if not isinstance(config, dict):
            continue
        tags = config.get("tag", [])
        names = {config.get("task"), *([tags] if isinstance(tags, str) else tags if isinstance(tags, list) else [])}
        if not names & wanted:
            continue
        files = (
            (config.get("dataset_kwargs") or {}).get("data_files")
            if isinstance(config.get("dataset_kwargs"), dict)
            else None
        )
        if isinstance(files, (str, list)):
            files = {"": files}
        exported = "farsight_data" in str(config.get("custom_dataset", ""))
        for entries in (files or {}).values() if isinstance(files, dict) else []:
            for entry in [entries] if isinstance(entries, str) else entries if isinstance(entries, list) else []:
                if not isinstance(entry, str) or any(c in entry for c in "*?[") or "://" in entry:
                    continue
                file = Path(entry) if Path(entry).is_absolute() else (path.parent if exported else Path.cwd()) / entry
                if not file.is_file():
                    fix = (
                        "the folder was moved or the file deleted since it was exported: export the tasks again"
                        if exported or Path(entry).is_absolute()
                        else f"a relative path is read from the working directory {Path.cwd()}: fix dataset_kwargs.data_files"
                    )
                    raise MissingFileError(f"{path}: its data file {entry} does not exist; {fix}")


def evaluate(
    pretrained: str,
    tasks: Sequence[str],
    *,
    include_path: str | None = None,
    limit: float | None = None,
    num_fewshot: int | None = None,
    batch_size: int = 1,
    memory: str = "device",
    kv_dtype: str | None = None,
    dtype: str = "fp32",
    device: str | None = None,
    log_samples: bool = False,
    align_context: bool = False,
    metadata: dict[str, Any] | None = None,
    retrieval_top_k: int | None = None,
    retrieval_neighbors: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """`lm_eval.simple_evaluate` of the farsight model directory `pretrained` on `tasks`; returns
    lm-eval's results dict (print it with lm_eval.utils.make_table).

    `metadata` goes to the tasks as lm-eval's `--metadata` does, e.g. {"max_seq_lengths": [4096,
    16384]} for its RULER tasks, which build their items with the tokenizer named by
    `tokenizer` or `pretrained` there: `pretrained` is this model's directory unless given."""
    import lm_eval

    if include_path is not None:
        check_task_data(include_path, tasks)
    # the tasks load the tokenizer from this path: a run's newest checkpoint is a model directory, the run is not
    directory = resolve_model_dir(pretrained)
    task_kwargs = {"pretrained": str(directory), **(metadata or {})}
    check_ruler_items_fit(tasks, task_kwargs)  # before lm-eval's task index, which takes seconds to build
    # the model's options (memory, dtype, retrieval top-k, ...) are refused before that index, too
    model = FarsightLM(
        pretrained,
        memory=memory,
        kv_dtype=kv_dtype,
        dtype=dtype,
        batch_size=batch_size,
        device=device,
        align_context=align_context,
        retrieval_top_k=retrieval_top_k,
        retrieval_neighbors=retrieval_neighbors,
    )
    manager = task_manager(tasks, include_path, task_kwargs)
    unknown = [task for task in tasks if task not in manager.all_tasks]
    if unknown:
        where = f"in {include_path} or " if include_path else ""
        raise InputError(
            f"lm-eval knows no task {unknown}; check the names {where}among lm-eval's tasks, or pass --include-path with their YAML"
        )
    try:
        return lm_eval.simple_evaluate(
            model=model,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            log_samples=log_samples,
        )
    except unreachable_hub_errors() as exc:  # a task's data could not be fetched (no network, or HF_HUB_OFFLINE=1)
        raise InputError(
            f"a task of {list(tasks)} needs its data from the Hugging Face Hub, which cannot be reached ({exc}); "
            "run it where the Hub can be reached or its dataset is cached, or use tasks whose data is local"
        ) from exc
    except ValueError as exc:
        if "Sample larger than population" not in str(exc):
            raise
        raise InputError(
            f"num_fewshot={num_fewshot} asks for more examples than a task of {list(tasks)} holds to draw them from; "
            "ask for fewer"
        ) from exc


def sample_records(samples: dict[str, list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    """lm-eval's logged samples (`simple_evaluate(log_samples=True)["samples"]`, task -> items) as
    one small record per item: the task, the item's id and length (RULER's `max_length`), the
    target, the model's answer after lm-eval's filters, and each of the item's scores. The prompt is
    left out: RULER's run to millions of characters."""
    for task, items in samples.items():
        for item in items:
            answers = item.get("filtered_resps") or [None]
            doc = item.get("doc") or {}
            yield {
                "task": task,
                "doc_id": item.get("doc_id"),
                "length": doc.get("max_length"),
                "target": item.get("target"),
                "answer": answers[0] if len(answers) == 1 else answers,
                "scores": {name: item[name] for name in item.get("metrics", []) if name in item},
            }
