"""Generation tasks: the answer is a JSON record under a contract, compared with each example's reference.
Config and data checks (pure), then a user's 3-field JSON task over a JSONL file of its own through `eval`, a
1-step tuning run (real model, Ray, W&B offline files, SQLite) and `predict`."""

import json
from pathlib import Path

import pytest
import yaml

from pipelines.cli import main
from pipelines.config import ConfigError, load_task
from pipelines.data import DataError, load_splits

DATA = Path(__file__).parent / "data"
TXN = str(DATA / "transactions_json.yaml")
FIELDS = {"merchant", "amount", "channel"}


def test_a_generation_task_loads_with_its_contract_references_and_defaults():
    task = load_task(TXN)
    assert task.is_generation and not task.labels and task.verbalizers == []
    assert task.scoring.decision == "answer" and task.scoring.metric == "field_exact_match"
    assert task.scoring.reward_metric == "field_exact_match"
    contract = task.output.output_contract()
    assert contract.kind == "json" and contract.extract == "first"
    splits = load_splits(task)
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (8, 8, 16)
    assert all(set(e.reference) == FIELDS and e.label == "" for e in splits.test)
    assert not {e.text for e in splits.test} & {e.text for e in splits.dev + splits.train}


@pytest.mark.parametrize("change, message", [
    ({"scoring.decision": "calibrated"}, "decision is its parsed answer"),
    ({"scoring.metric": "balanced_accuracy"}, "needs labels"),
    ({"output.contract": {"kind": "labels", "labels": ["a", "b"], "words": ["x", "y"]}}, "must be json or regex"),
    ({"output.contract": {"kind": "json", "schema": {"type": "objekt"}}}, "type must be"),
    ({"labels": {"a": {"values": ["a"], "verbalizer": "a"}}}, "has no labels"),
])
def test_a_generation_task_refuses_what_belongs_to_labels(change, message):
    with pytest.raises(ConfigError, match=message):
        load_task(TXN).with_overrides(**change)


def test_a_labelled_task_refuses_generation_metrics_and_a_task_needs_labels_or_an_output():
    with pytest.raises(ConfigError, match="measure generated answers"):
        load_task("risk").with_overrides(**{"scoring.metric": "token_f1"})
    with pytest.raises(ConfigError, match="two or more labels .* or an output"):
        load_task(str(DATA / "cases_4label.yaml")).with_overrides(labels={})


def test_a_reference_that_breaks_the_contract_is_named_with_its_row(tmp_path):
    rows = [{"case": f"Card payment of {i} EUR at Shop {i}", "reference": {"merchant": f"Shop {i}", "amount": i,
                                                                             "channel": "card"}} for i in range(40)]
    rows[6]["reference"]["channel"] = "cheque"
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = Path(TXN).read_text().replace("source: transactions_json.jsonl", f"source: {tmp_path / 'data.jsonl'}")
    (tmp_path / "task.yaml").write_text(text)
    with pytest.raises(DataError, match=r"data row 7: the reference answer breaks the output contract \('\$\.channel"):
        load_splits(load_task(str(tmp_path / "task.yaml")))


def test_the_callback_builtin_takes_each_messages_first_phone_number_as_its_reference():
    from rewards.entities import find_entities

    task = load_task("callback")
    contract = task.output.output_contract()
    assert contract.kind == "regex" and contract.extract == "first" and task.data.reference_entity == "phone"
    splits = load_splits(task)
    assert (len(splits.train), len(splits.dev), len(splits.test)) == (40, 64, 300)
    for example in splits.train + splits.dev + splits.test:
        first = next(e.value for e in find_entities(example.text) if e.type == "phone")
        assert example.reference == first and contract.parse(f"It is {first}.").value == first
    assert not {e.text for e in splits.test} & {e.text for e in splits.dev + splits.train}


def test_references_from_entities_skip_rows_without_one_and_belong_to_generation_tasks(tmp_path):
    rows = ["text"] + [f"Call 0800 {100 + i} 4000 today" if i % 2 else f"See you at {i}" for i in range(40)]
    (tmp_path / "msgs.csv").write_text("\n".join(rows))
    spec = yaml.safe_load((Path(__file__).parent.parent / "pipelines" / "tasks" / "callback.yaml").read_text())
    spec["data"] = {"source": "msgs.csv", "reference_entity": "phone"}
    spec["split"] = {"train": 4, "dev": 4, "test": 12}
    text = yaml.safe_dump(spec)
    (tmp_path / "task.yaml").write_text(text)
    examples = load_splits(load_task(str(tmp_path / "task.yaml")))
    assert sorted(e.reference for e in examples.test + examples.dev + examples.train) == sorted(
        f"0800 {100 + i} 4000" for i in range(1, 40, 2))
    with pytest.raises(ConfigError, match="remove data.reference_entity"):
        load_task("risk").with_overrides(**{"data.reference_entity": "phone"})


@pytest.mark.e2e
def test_a_json_user_task_runs_through_eval(capsys):
    """eval on the JSON task: its contract, metrics and rates over the test split."""
    assert main(["eval", "--task", TXN, "--split", "test", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 16 and report["valid"]
    assert report["decision"]["kind"] == "answer" and report["decision"]["contract"]["kind"] == "json"
    assert set(report["metrics"]) == {"field_exact_match", "token_f1", "contract_rate"}
    kept = report["rates"]["instruction_following"]
    assert kept["of"] == 16 and report["metrics"]["contract_rate"] == pytest.approx(kept["kept"] / 16)
    assert report["rates"]["entity_consistency"]["of"] == 16
    assert all(0.0 <= v <= 1.0 for v in report["metrics"].values())
    for sample in report["samples"]:  # the reference shown next to what the contract made of the answer
        assert set(json.loads(sample["label"])) == FIELDS
        assert (not sample["contract_kept"]) or set(json.loads(sample["parsed"])) >= FIELDS


@pytest.mark.slow
def test_a_json_user_task_runs_through_tuning_the_store_and_predict(tmp_path, capsys, ray_session):
    """A tuning run on the JSON task, its version in the store, and predict serving it (slow: one more real run; the
    default tier's end-to-end run is tests/test_tuning.py's)."""
    run_dir, store = tmp_path / "run", f"sqlite:///{tmp_path / 'store.sqlite'}"
    code = main(["--task", TXN, "--steps", "1", "--dev-examples", "0", "--run-dir", str(run_dir), "--store", store])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "held-out test split" in out and "field_exact_match" in out
    tuned = json.loads((run_dir / "report.json").read_text())
    assert tuned["steps"] == 1 and tuned["test"][0]["template_name"] == "seed"
    assert all(0.0 <= row["field_exact_match"] <= 1.0 for row in tuned["test"])

    text = "Card payment of 42.00 EUR at Bistro Luna that the customer does not recognise."
    assert main(["predict", "--task", TXN, "--store", store, "--json", "--text", text]) == 0
    (served,) = json.loads(capsys.readouterr().out)
    assert served["label"] is None and served["answer"]
    assert (served["value"] is None) == bool(served["contract_broken"])
    assert served["value"] is None or set(served["value"]) >= FIELDS
    assert main(["store", "show", "txn-fields@production", "--store", store]) == 0
    assert "first JSON value in the answer" in capsys.readouterr().out


PRODUCTS = str(DATA / "products_multi.yaml")


def test_several_inputs_each_with_its_constraint_reach_the_scorer_as_one_span():
    from templates.template import Template

    task = load_task(PRODUCTS)
    assert task.input_variables == ("category", "price_range")
    template = task.seed_template()
    assert template.variables == ("category", "price_range")
    frame, span = template.input_frame()
    assert frame.variables == ("input_span",) and span.text == "{category}\nPrice range (USD): {price_range}"
    splits = load_splits(task)
    for e in splits.dev:  # the span is what the scorers see; the frame around it is shared by every example
        assert e.text == span.render(e.values)
        assert frame.render(input_span=e.text) == template.render(e.inputs(task.input_variable))
    with pytest.raises(Exception, match="constraint failed"):
        template.render({"category": "cars", "price_range": "100-200"})
    from pipelines.generation import candidate_text, instruction_of

    text = candidate_text(task, "Suggest three good products for this budget.")
    assert instruction_of(task, text) == "Suggest three good products for this budget."
    assert Template(text, task.input_variables).placeholders == ("category", "price_range")


def test_a_row_that_breaks_an_input_constraint_is_named_and_predict_wants_json_values(tmp_path):
    from pipelines.cli_production import input_values

    rows = [json.loads(line) for line in (DATA / "products_multi.jsonl").read_text().splitlines()]
    rows[2]["price_range"] = "cheap"
    (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    text = Path(PRODUCTS).read_text().replace("source: products_multi.jsonl", f"source: {tmp_path / 'data.jsonl'}")
    (tmp_path / "task.yaml").write_text(text)
    with pytest.raises(DataError, match="data row 3: .*price_range"):
        load_splits(load_task(str(tmp_path / "task.yaml")))
    task = load_task(PRODUCTS)
    assert input_values(task, '{"category": "phones", "price_range": "100-200"}') == {
        "category": "phones", "price_range": "100-200"}
    for bad in ("phones 100-200", '{"category": "phones"}', "[1, 2]"):
        with pytest.raises(ConfigError, match="give each --text as a JSON object with exactly the keys"):
            input_values(task, bad)


@pytest.mark.e2e
def test_a_task_with_two_inputs_runs_through_eval(capsys):
    assert main(["eval", "--task", PRODUCTS, "--split", "test", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["examples"] == 8 and report["valid"]
    assert set(report["metrics"]) == {"field_exact_match", "token_f1", "contract_rate"}
    assert all("\nPrice range (USD): " in s["input"] for s in report["samples"])


def test_serving_a_two_input_version_hands_the_target_its_frame_and_the_values_span(tmp_path):
    """TemplateReader.predict: what a scorer would see at tuning time (frame + span), the parsed JSON back."""
    from pipelines.engine.answers import Answer
    from pipelines.scoring import output_contract
    from templates.decision import DecisionRule
    from templates.gate import Decision
    from templates.serving import TemplateReader
    from templates.store import TemplateStore
    from templates.template import Template

    task = load_task(PRODUCTS)
    seed = task.seed_template()
    rule = DecisionRule("answer", (), (), contract=output_contract(task), max_new_tokens=40)
    version = Template(seed.text, seed.variables, seed.constraints, rule)
    url = f"sqlite:///{tmp_path / 'store.sqlite'}"
    with TemplateStore(url) as store:
        store.promote(task.name, store.add_version(task.name, version, decision=Decision(True, ("pass",))).id)

    class Target:
        verbalizers = ["yes", "no"]
        seen = []

        def answer(self, template, texts, max_new_tokens, complete):
            self.seen.append((template.text, list(texts)))
            return [Answer('Sure: ["A", "B", "C"] and more', True, 40)]

    reader = TemplateReader(url)
    try:
        got = reader.predict(task.name, {"category": "phones", "price_range": "100-200"}, Target())
        with pytest.raises(Exception, match="constraint failed"):
            reader.predict(task.name, {"category": "cars", "price_range": "100-200"}, Target())
    finally:
        reader.close()
    assert got.value == ["A", "B", "C"] and got.label is None and got.reason == ""
    ((frame_text, texts),) = Target.seen
    assert texts == ["phones\nPrice range (USD): 100-200"] and "{input_span}" in frame_text
