"""The lm-eval model "farsight": simple_evaluate on small local tasks equals the same numbers
computed by hand on farsight's sessions, from Python and from `farsight eval harness`; lm-eval's
own model "hf" (HFLM, through the Auto classes) gives the same numbers and truncates nothing."""

import json

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

lm_eval = pytest.importorskip("lm_eval")

import farsight.errors  # noqa: E402
import farsight.hf  # noqa: E402,F401  (registers "farsight" with lm-eval)
from farsight.cli import main  # noqa: E402
from farsight.data.tokenizers import load_tokenizer  # noqa: E402
from farsight.hf import FarsightForCausalLM  # noqa: E402
from farsight.hf.configuration import UNBOUNDED_POSITIONS  # noqa: E402
from farsight.hf.harness import task_manager  # noqa: E402
from farsight.models import load_model  # noqa: E402
from farsight.models.io import trained_weights  # noqa: E402

DOCS = [
    {
        "context": "The passkey is 4821. Hay hay hay.",
        "choices": [" 4821", " 1234", " 9090", " 5555"],
        "answer": 0,
        "passkey": "4821",
    },
    {
        "context": "Grass is green. The passkey is 7070.",
        "choices": [" 1111", " 7070", " 3141", " 2718"],
        "answer": 1,
        "passkey": "7070",
    },
    {
        "context": "The passkey is 12. Sky is blue.",
        "choices": [" 12", " 99", " 123", " 7"],
        "answer": 0,
        "passkey": "12",
    },
]
PROMPT = "{{context}}\nWhat is the passkey? The passkey is"


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    data = folder / "passkey.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    common = f'dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\ntarget_delimiter: ""\ndoc_to_text: "{PROMPT}"\n'
    (folder / "mc.yaml").write_text(
        "task: farsight_passkey_mc\noutput_type: multiple_choice\n"
        + common
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "gen.yaml").write_text(
        "task: farsight_passkey_gen\noutput_type: generate_until\n"
        + common
        + 'doc_to_target: " {{passkey}}"\ngeneration_kwargs:\n  until: [".", "\\n"]\n  max_gen_toks: 6\n'
        + "metric_list:\n  - metric: exact_match\n"
    )
    return folder


def loglikelihood_by_hand(model, tokenizer, context, continuation, align=False):
    """log p(continuation | context): prefill the context (as blocks: fed as they are; as a
    tensor: aligned to end on a chunk boundary), score the continuation."""
    with model.new_session(1) as session:
        ids = torch.tensor([tokenizer.encode(context)])
        session.prefill(ids if align else iter([ids]))
        return float(session.score(torch.tensor([tokenizer.encode(continuation)])).sum())


def greedy_text_by_hand(model, tokenizer, context, max_new_tokens=6, until=(".", "\n")):
    """farsight's greedy generate, decoded and cut before the first stop string."""
    ids = torch.tensor([tokenizer.encode(context)])
    text = tokenizer.decode(
        model.generate(ids, max_new_tokens, temperature=0, eos_token_id=tokenizer.eos_id)[0, ids.shape[1] :].tolist()
    )
    return min((text[: text.index(stop)] for stop in until if stop in text), key=len, default=text)


@pytest.mark.parametrize("align", [False, True])
def test_simple_evaluate_equals_the_sessions_by_hand(tiny_drt_dir, tasks, align):
    names = ["farsight_passkey_mc", "farsight_passkey_gen"]
    results = lm_eval.simple_evaluate(
        model="farsight",
        model_args=f"pretrained={tiny_drt_dir},memory=disk,batch_size=4" + (",align_context=true" if align else ""),
        tasks=names,
        task_manager=task_manager(names, str(tasks)),
        log_samples=True,
    )
    model, tokenizer = load_model(tiny_drt_dir).eval(), load_tokenizer(tiny_drt_dir)
    correct = 0
    for sample in results["samples"]["farsight_passkey_mc"]:
        expected = [loglikelihood_by_hand(model, tokenizer, *pair, align=align) for pair in sample["arguments"]]
        assert [resp[0][0] for resp in sample["resps"]] == pytest.approx(expected, abs=1e-4)
        correct += expected.index(max(expected)) == DOCS[sample["doc_id"]]["answer"]
    assert results["results"]["farsight_passkey_mc"]["acc,none"] == pytest.approx(correct / len(DOCS))
    for sample in results["samples"]["farsight_passkey_gen"]:
        assert sample["resps"][0][0] == greedy_text_by_hand(model, tokenizer, sample["arguments"][0][0])


def test_farsight_eval_harness_prints_the_table_and_writes_json(tiny_drt_dir, tasks, tmp_path, capsys):
    out = tmp_path / "results.json"
    code = main(
        [
            "eval",
            "harness",
            "--model",
            str(tiny_drt_dir),
            "--tasks",
            "farsight_passkey_mc",
            "--include-path",
            str(tasks),
            "--limit",
            "2",
            "--batch-size",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "farsight_passkey_mc" in capsys.readouterr().out
    python = lm_eval.simple_evaluate(
        model="farsight",
        model_args=f"pretrained={tiny_drt_dir}",
        tasks=["farsight_passkey_mc"],
        limit=2,
        task_manager=task_manager(["farsight_passkey_mc"], str(tasks)),
    )
    assert json.loads(out.read_text())["results"]["farsight_passkey_mc"] == pytest.approx(
        python["results"]["farsight_passkey_mc"]
    )
    written = json.loads(out.read_text())
    # what a model card checks: the model, and the trained weights that any copy of it shares
    assert (written["model"], written["dtype"]) == (str(tiny_drt_dir), "fp32")
    assert written["trained_weights"] == trained_weights(tiny_drt_dir) is not None


def test_eval_harness_samples_hold_each_items_target_answer_and_score(tiny_drt_dir, tasks, tmp_path, capsys):
    samples = tmp_path / "deep" / "samples.jsonl"
    argv = ["eval", "harness", "--model", str(tiny_drt_dir), "--include-path", str(tasks)]
    code = main([*argv, "--tasks", "farsight_passkey_gen,farsight_passkey_mc", "--samples", str(samples)])
    assert code == 0
    assert "farsight_passkey_gen" in (out := capsys.readouterr().out) and "doc_id" not in out
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    generated = sorted((r for r in records if r["task"] == "farsight_passkey_gen"), key=lambda r: r["doc_id"])
    assert [r["doc_id"] for r in generated] == [0, 1, 2]
    model, tokenizer = load_model(tiny_drt_dir).eval(), load_tokenizer(tiny_drt_dir)
    for r, doc in zip(generated, DOCS):
        assert r["target"] == f" {doc['passkey']}"
        context = PROMPT.replace("{{context}}", doc["context"])
        assert r["answer"] == greedy_text_by_hand(model, tokenizer, context)
        assert r["scores"] == {"exact_match": float(r["answer"] == r["target"])}
    chosen = [r for r in records if r["task"] == "farsight_passkey_mc"]
    assert len(chosen) == 3 and all(set(r["scores"]) == {"acc"} and len(r["answer"]) == 4 for r in chosen)
    # a folder where the file should go is refused before anything runs
    assert main([*argv, "--tasks", "farsight_passkey_gen", "--samples", str(tmp_path)]) == 2
    assert "--samples" in capsys.readouterr().err


def test_eval_harness_align_context_reaches_the_model(tiny_drt_dir, tasks, monkeypatch):
    import farsight.hf.harness as harness

    seen = []
    monkeypatch.setattr(
        harness.FarsightLM,
        "_score_by_context",
        lambda self, pairs, *a: seen.append(self.align_context) or [(0.0, True)] * len(pairs),
    )
    argv = [
        "eval",
        "harness",
        "--model",
        str(tiny_drt_dir),
        "--tasks",
        "farsight_passkey_mc",
        "--include-path",
        str(tasks),
        "--limit",
        "1",
    ]
    assert main(argv) == 0 and main([*argv, "--align-context"]) == 0
    assert seen == [False, True]
    with pytest.raises(farsight.errors.InputError, match="align_context='maybe' must be true or false"):
        harness.FarsightLM(str(tiny_drt_dir), align_context="maybe")


def test_farsight_eval_harness_refuses_unknown_tasks(tiny_drt_dir, tasks, capsys):
    assert (
        main(["eval", "harness", "--model", str(tiny_drt_dir), "--tasks", "no_such_task", "--include-path", str(tasks)])
        == 2
    )
    assert "no_such_task" in capsys.readouterr().err


@pytest.mark.parametrize("native", [False, True])
def test_bf16_scoring_and_generation_widen_the_products_this_cpu_lacks(native, tiny_drt_dir, monkeypatch, widened_ops):
    from types import SimpleNamespace

    from farsight.hf.harness import FarsightLM
    from farsight.ops import precision

    monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
    lm = FarsightLM(str(tiny_drt_dir), dtype="bf16", device="cpu")
    context, continuation = lm.tok_encode("The passkey is 4821."), lm.tok_encode(" 4821")
    [(logprob, _)] = lm._loglikelihood_tokens([(("", ""), context, continuation)], disable_tqdm=True)
    assert logprob < 0 and bool(widened_ops) != native
    widened_ops.clear()
    [text] = lm.generate_until(
        [SimpleNamespace(args=("The passkey is", {"until": ["."], "max_gen_toks": 3}))], disable_tqdm=True
    )
    assert isinstance(text, str) and bool(widened_ops) != native


def write_tasks(folder, docs, question, max_gen_toks=16):
    """A multiple-choice (log-likelihood) and a generate_until task over `docs`, each prompt
    "{context}{question}"."""
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    common = (
        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        f'target_delimiter: ""\ndoc_to_text: "{{{{context}}}}{question}"\n'
    )
    (folder / "mc.yaml").write_text(
        "task: hf_passkey_mc\noutput_type: multiple_choice\n"
        + common
        + 'doc_to_choice: "{{choices}}"\ndoc_to_target: answer\nmetric_list:\n  - metric: acc\n'
    )
    (folder / "gen.yaml").write_text(
        "task: hf_passkey_gen\noutput_type: generate_until\n"
        + common
        + f'doc_to_target: " {{{{passkey}}}}"\ngeneration_kwargs:\n  until: ["."]\n  max_gen_toks: {max_gen_toks}\n'
        + "metric_list:\n  - metric: exact_match\n"
    )
    return ["hf_passkey_mc", "hf_passkey_gen"]


def test_lm_evals_hf_model_equals_farsights_own(drt_dir, tmp_path):
    """simple_evaluate(model="hf") (HFLM: the Auto classes, device_map={"": "cpu"}, forward for
    log-likelihoods, generate with lm-eval's stopping criteria, batches padded) against
    model="farsight", on the demo DRT, with prompts of three lengths that are not whole chunks
    (the byte tokenizer: a character is a token): both score the stream from the context's first
    token, and both generate from an aligned prompt."""
    question = " What is the passkey? The passkey"
    chunk = load_model(drt_dir).config.chunk_size
    docs = []
    for i, doc in enumerate(DOCS):
        text = doc["context"] + " Hay hay." * (4 * i)
        choices = [f" {doc['passkey']}.", " 1234.", " 9090.", " 5555."]
        docs.append({"context": text, "choices": choices, "answer": 0, "passkey": doc["passkey"]})
    assert len({len(doc["context"]) for doc in docs}) == 3
    assert all((len(doc["context"]) + len(question)) % chunk for doc in docs)
    model, tokenizer = load_model(drt_dir).eval(), load_tokenizer(drt_dir)
    layouts = [loglikelihood_by_hand(model, tokenizer, docs[1]["context"] + question, " 7070.", a) for a in (0, 1)]
    assert abs(layouts[0] - layouts[1]) > 1e-3  # so the layout the two models agree on is tested
    names = write_tasks(tmp_path, docs, question)
    runs = {
        model: lm_eval.simple_evaluate(
            model=model,
            # HFLM's default dtype="auto" would load the demo's bf16 weights as bf16; both score in fp32
            model_args=f"pretrained={drt_dir},batch_size=4" + (",device=cpu,dtype=float32" if model == "hf" else ""),
            tasks=names,
            task_manager=task_manager(names, str(tmp_path)),
            log_samples=True,
        )
        for model in ("farsight", "hf")
    }
    ours, theirs = runs["farsight"], runs["hf"]
    for a, b in zip(ours["samples"]["hf_passkey_mc"], theirs["samples"]["hf_passkey_mc"], strict=True):
        assert [r[0][0] for r in b["resps"]] == pytest.approx([r[0][0] for r in a["resps"]], abs=1e-4)
        assert [r[0][1] for r in b["resps"]] == [r[0][1] for r in a["resps"]]  # greedy matches
    texts = [[s["resps"][0][0] for s in run["samples"]["hf_passkey_gen"]] for run in (ours, theirs)]
    assert texts[0] == texts[1] and all(text.strip() for text in texts[0])
    for name in names:
        assert theirs["results"][name] == pytest.approx(ours["results"][name])


def test_lm_evals_hf_model_passes_a_64k_token_context_to_a_drt_whole(tiny_drt_dir, tmp_path, monkeypatch):
    """HFLM truncates to max_position_embeddings (else tokenizer.model_max_length): a DRT reads
    any length, so what HFLM hands the model is the whole 64K-token prompt. The model is a spy
    (a 64K-token forward of a real DRT is not this test's business)."""
    context = ("The grass is green. The sky is blue. " * 2000)[:65536]  # bytes: 65,536 tokens
    docs = [{"context": context, "choices": [" 12", " 99"], "answer": 0, "passkey": "12"}]
    names = write_tasks(tmp_path, docs, "", max_gen_toks=3)
    seen = {"forward": [], "generate": []}

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        seen["forward"].append(tuple(input_ids.shape))
        return CausalLMOutputWithPast(logits=torch.zeros(*input_ids.shape, self.config.vocab_size))

    def generate(self, inputs=None, **kwargs):
        ids = kwargs["input_ids"]
        seen["generate"].append(tuple(ids.shape))
        return torch.cat([ids, ids.new_full((ids.shape[0], 3), ord("."))], dim=1)

    monkeypatch.setattr(FarsightForCausalLM, "forward", forward)
    monkeypatch.setattr(FarsightForCausalLM, "generate", generate)
    lm = lm_eval.api.registry.get_model("hf")(pretrained=str(tiny_drt_dir), device="cpu")
    assert lm.max_length == lm.model.config.max_position_embeddings == UNBOUNDED_POSITIONS
    assert lm.tokenizer.model_max_length >= UNBOUNDED_POSITIONS  # transformers' "no limit"
    lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=task_manager(names, str(tmp_path)))
    assert seen["forward"] and {shape[1] for shape in seen["forward"]} == {65536 + 3 - 1}  # context + choice - 1
    assert seen["generate"] == [(1, 65536)]


def test_eval_harness_metadata_reaches_the_tasks_with_the_models_tokenizer(tiny_drt_dir, tasks, monkeypatch, capsys):
    """--metadata goes to lm-eval's TaskManager (RULER's max_seq_lengths), with `pretrained` naming
    the model's directory, which RULER's generators load their tokenizer from; bad JSON is one line."""
    import farsight.hf.harness as harness

    seen = []
    real = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda *a: seen.append(a[2]) or real(*a))
    argv = ["eval", "harness", "--model", str(tiny_drt_dir), "--tasks", "farsight_passkey_mc"]
    argv += ["--include-path", str(tasks), "--limit", "1"]
    assert main([*argv, "--metadata", '{"max_seq_lengths": [4096, 16384]}']) == 0
    assert main(argv) == 0
    assert seen == [
        {"pretrained": str(tiny_drt_dir), "max_seq_lengths": [4096, 16384]},
        {"pretrained": str(tiny_drt_dir)},
    ]
    capsys.readouterr()
    assert main([*argv, "--metadata", "{max_seq_lengths: 4096}"]) == 2
    assert (
        "--metadata: invalid JSON (Expecting property name enclosed in double quotes at column 2); pass an object"
        in capsys.readouterr().err
    )
    assert main([*argv, "--metadata", "[4096]"]) == 2
    assert "--metadata: a JSON array where a JSON object belongs; pass an object" in capsys.readouterr().err
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_drt_dir))  # what RULER's generators do with it
    assert tokenizer("The quick brown fox").input_ids


def test_eval_harness_refuses_ruler_tasks_whose_smallest_items_do_not_fit(tiny_drt_dir, capsys):
    """lm-eval's ruler_vt shrinks its few-shot example until it fits in 500 tokens and retries
    forever when the smallest does not, which in byte tokens it never does; ruler_cwe at 4K builds
    items with no words when its 10-word item does not fit (about 7K byte tokens) and fails to
    score them at the end. Both refused in one line before lm-eval starts, alone or in the `ruler`
    group, leaving the random states lm-eval draws its items from as they were."""
    import random

    import numpy as np

    from farsight.hf.harness import check_ruler_items_fit

    argv = ["eval", "harness", "--model", str(tiny_drt_dir), "--metadata"]
    assert main([*argv, '{"max_seq_lengths": [131072]}', "--tasks", "niah_single_1,ruler_vt"]) == 2
    err = capsys.readouterr().err.strip()
    assert "ruler_vt" in err and "500" in err and len(err.splitlines()) == 1
    states = random.getstate(), np.random.get_state()[1].copy()
    with pytest.raises(farsight.errors.InputError, match="ruler_cwe cannot build items of 4096 tokens"):
        check_ruler_items_fit(["ruler_cwe"], {"pretrained": str(tiny_drt_dir), "max_seq_lengths": [16384, 4096]})
    with pytest.raises(farsight.errors.InputError, match="ruler_vt"):
        check_ruler_items_fit(["ruler"], {"pretrained": str(tiny_drt_dir), "max_seq_lengths": [131072]})
    assert random.getstate() == states[0] and (np.random.get_state()[1] == states[1]).all()
    # what fits passes: cwe from 16K on, and the tasks with nothing to check
    check_ruler_items_fit(["ruler_cwe", "niah_single_1"], {"pretrained": str(tiny_drt_dir), "max_seq_lengths": [16384]})


def test_eval_harness_on_a_training_run_names_its_newest_checkpoint_to_the_tasks(
    tiny_drt_dir, tasks, tmp_path, monkeypatch
):
    """A run directory holds no tokenizer the tasks could load: `pretrained` names the run's newest
    checkpoint, a model directory that transformers' AutoTokenizer loads (RULER's generators do)."""
    import shutil

    from transformers import AutoTokenizer

    import farsight.hf.harness as harness

    run = tmp_path / "run"
    for step in ("step_00000005", "step_00000010"):
        shutil.copytree(tiny_drt_dir, run / "checkpoints" / step)
    seen = []
    real = harness.task_manager
    monkeypatch.setattr(harness, "task_manager", lambda *a: seen.append(a[2]) or real(*a))
    argv = ["eval", "harness", "--model", str(run), "--tasks", "farsight_passkey_mc", "--include-path", str(tasks)]
    assert main([*argv, "--limit", "1"]) == 0
    newest = run / "checkpoints" / "step_00000010"
    assert seen == [{"pretrained": str(newest)}]
    assert AutoTokenizer.from_pretrained(seen[0]["pretrained"])("The grass is green.").input_ids


def test_more_few_shot_examples_than_a_task_holds_and_unreachable_data_are_one_line(
    tiny_drt_dir, tasks, tmp_path, capsys, monkeypatch
):
    base = ["eval", "harness", "--model", str(tiny_drt_dir), "--include-path", str(tasks), "--limit", "1"]
    assert main([*base, "--tasks", "farsight_passkey_mc", "--num-fewshot", "5"]) == 2
    err = capsys.readouterr().err
    assert "num_fewshot=5 asks for more examples than a task of ['farsight_passkey_mc'] holds" in err
    assert err.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in err

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'someone/data' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(lm_eval, "simple_evaluate", unreachable)
    assert main([*base, "--tasks", "farsight_passkey_mc"]) == 2
    assert "needs its data from the Hugging Face Hub, which cannot be reached" in capsys.readouterr().err


@pytest.mark.parametrize("option", [{"retrieval_top_k": 2}, {"dtype": "fp12"}, {"memory": "tape"}])
def test_harness_refuses_a_bad_model_option_before_building_lm_evals_task_index(castle_dir, option, monkeypatch):
    from farsight.hf import harness

    def index_built(*args):
        raise AssertionError("lm-eval's task index was built before the model's options were checked")

    monkeypatch.setattr(harness, "task_manager", index_built)
    with pytest.raises(farsight.errors.FarsightError):
        harness.evaluate(str(castle_dir), ["niah_single_1"], **option)
