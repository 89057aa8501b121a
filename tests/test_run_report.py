"""The run report page (pipelines/run_report.py, `tune-prompts report`): its sections and figures on a report
shaped like a real run's, escaping of model output, no external resources, a real browser's rendering, and the
command's errors. The page of a real run is checked in tests/test_tuning.py's end-to-end test."""

import copy
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest

from pipelines.cli import main
from pipelines.run_report import SECTIONS, write_html

HOSTILE = '<script>alert("x")</script> & <img src=https://evil.example/x.png>'
BARS = ["pass: instruction_following 1 >= 0.82", "pass: entity_consistency 0.9635 >= 0.78",
        "fail: balanced_accuracy 0.815 vs incumbent 0.695: gain +0.002 < required 0.01",
        "pass: template_tokens 35 <= 160", "pass: latency_p95_ms 215.7 <= 244.2 (incumbent 195.3 +25%)",
        "pass: render_us_p99 1.151 <= 50", "pass: error_rate 0 <= 0.01"]
SAMPLE = {"input": "Customer service announcement <b>call</b> 07099833605", "answer": HOSTILE, "parsed": "high_risk",
          "contract_kept": True, "decision": "high_risk", "label": "high_risk"}


def row_on_test(name: str, instruction: str) -> dict:
    return {"template_name": name, "instruction": instruction, "valid": True, "decision": "calibrated",
            "total_reward": 3.6, "balanced_accuracy": 0.815, "accuracy": 0.815, "macro_f1": 0.81, "roc_auc": 0.877,
            "instruction_following": 1.0, "entity_consistency": 0.963, "readability": 0.73,
            "instruction_following_n": "40/40", "entity_consistency_n": "21/22", "tokens": 35,
            "latency_p95_ms": 215.7, "render_us_p99": 1.15, "template": instruction + "\nMessage: {text}",
            "gate_passed": False, "gate_reasons": BARS, "balanced_accuracy_ci95": [0.76, 0.86],
            "pdr/checklist": 0.13, "coherence": 0.12, "samples": [SAMPLE] * 10}


def step_scalars(step: int) -> dict:
    return {"reward/total/mean": 1.2 + step, "reward/task_metric/mean": 0.55, "reward/readability/mean": 0.53,
            "reward/length/mean": -0.25, "train/feasible_fraction": 0.375, "train/valid_fraction": 1.0,
            "train/best_reward": 2.6, "timing/generate_s": 21.1, "timing/score_s": 27.2, "timing/update_s": 48.0}


def candidate(step: int, i: int, instruction: str) -> dict:
    return {"step": step, "instruction": instruction, "valid": i < 3, "tokens": 30 + i, "prompt_ratio": 1.1,
            "total_reward": 1.5 + i / 10, "invalid_reasons": "" if i < 3 else "no {text}", "balanced_accuracy": 0.7,
            "target_calls": 40,
            "judge_calls": 0, "task_metric": 0.5, "readability": 0.6, "length": -0.2,
            "instruction_following_n": "24/24", "entity_consistency_n": None, "finished_race": i == 0}


# the shape of a real run's report.json (a 2-step risk run that chose a candidate), with model output that
# carries markup
REPORT = {
    "task": "risk", "run_dir": "/tmp/r2/run", "steps": 2, "stopped": None, "wandb_folder": "/tmp/r2/run/wandb/x",
    "target_calls": 5307,
    "usage": {"total": {"target": {"calls": 5307, "prompt_tokens": 520159, "completion_tokens": 2603},
                        "judge": {"calls": 36, "prompt_tokens": 6501, "completion_tokens": 0},
                        "policy": {"calls": 32, "prompt_tokens": 5040, "completion_tokens": 845}},
              "phases": {"seed": {"target": {"calls": 100, "prompt_tokens": 8789, "completion_tokens": 0}},
                         "steps": {"policy": {"calls": 32, "prompt_tokens": 5040, "completion_tokens": 845}}}},
    "estimate": {"for_steps_run": {"target": {"calls": 5965, "prompt_tokens": 713556, "completion_tokens": 8640}}},
    "choice": {"chosen": HOSTILE + "\nMessage: {text}", "verdict": "chose candidate 1 on dev: balanced_accuracy 0.800",
               "ranking": [{"name": "candidate 1", "template": HOSTILE, "instruction": HOSTILE, "valid": True,
                            "tokens": 35, "balanced_accuracy": 0.8, "latency_p95_ms": 204.8, "gain": 0.125,
                            "gain_lower": 0.07, "p_value": 0.0, "feasible": True, "beats_seed": True, "chosen": True,
                            "bars": BARS + ["pass: paired bootstrap over 200 dev examples: gain +0.125, p 0 < 0.05"]},
                           {"name": "seed", "template": "Read the SMS.", "instruction": "Read the SMS.", "valid": True,
                            "tokens": 24, "balanced_accuracy": 0.675, "latency_p95_ms": 188.5, "gain": None,
                            "gain_lower": None, "p_value": None, "feasible": None, "beats_seed": False,
                            "chosen": False, "bars": BARS}],
               "front": [{"name": "seed", "tokens": 24, "balanced_accuracy": 0.675}]},
    "test": [row_on_test("seed", "Read the SMS message below."), row_on_test("chosen", HOSTILE)],
    "history": [step_scalars(1), step_scalars(2)],
    "learning": [{"step": s, "mean_reward": 1.2 + s, "feasible_fraction": 0.375, "valid_fraction": 1.0,
                  "best_so_far": 2.6, "samples": {"rewards": [0.9, 2.4, -0.9, 2.6], "feasible": [False, True, False, True]}}
                 for s in (1, 2)],
    "candidates": [candidate(s, i, HOSTILE if i == 0 else f"Instruction {s}.{i}") for s in (1, 2) for i in range(4)],
    "scorer_workers_replaced": 0,
    "timings": {"timing/startup_s": 10.2, "timing/select_s": 63.2, "timing/test_eval_s": 95.4, "timing/total_s": 420.0},
    "promotion": {"version": 2, "promoted": False, "reasons": BARS, "production": 1},
}


class Tags(HTMLParser):
    """The page's elements and their attributes, as a browser's parser reads them."""

    def __init__(self, page: str):
        super().__init__()
        self.found: list[tuple[str, dict]] = []
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict(attrs)))


def sections(page: str) -> dict[str, str]:
    """Each <section id=...>'s HTML."""
    return dict(re.findall(r'<section id="(\w+)">(.*?)</section>', page, re.S))


def test_the_page_has_every_section_figures_and_escapes_model_output(tmp_path):
    page = write_html(REPORT, tmp_path / "report.html").read_text()
    found = sections(page)
    assert list(found) == list(SECTIONS) == ["learning", "candidates", "test", "samples", "gate", "store", "usage"]
    assert all(re.search(r"<h2>[^<]+</h2>", html) for html in found.values())
    assert found["learning"].count("<svg") == 2 and "<svg" in found["test"] and "<svg" in found["usage"]
    # model output is text, never markup; the page loads nothing and runs nothing
    tags = Tags(page).found
    assert not {"script", "img", "link", "iframe", "object"} & {tag for tag, _ in tags} and "&lt;script&gt;" in page
    links = [value for _, attrs in tags for name, value in attrs.items() if name in ("src", "href", "xlink:href")]
    assert links and all(value.startswith("#") for value in links)  # the sections' and the figures' own ids
    assert "default-src 'none'" in page
    # the figures a reviewer reads: counts with Wilson intervals, the bootstrap interval, every bar, the store
    assert "40/40; 95% 0.912&ndash;1.000" in found["test"] and "0.760&ndash;0.860" in found["test"]
    assert found["samples"].count("<tr>") == 2 * (10 + 1)
    assert "gain +0.002 &lt; required 0.01" in found["gate"] and "paired bootstrap" in found["gate"]
    assert "not promoted" in found["gate"] and "production version after the run" in found["store"]
    assert found["candidates"].count("<tr>") == 8 + 1 and "candidate 1" in found["candidates"]  # the finalist
    assert found["candidates"].count("invalid: no {text}") == 2
    assert "420.0 s" in found["usage"]


def test_a_run_that_stopped_early_chose_and_stored_nothing_still_renders(tmp_path):
    report = copy.deepcopy(REPORT)
    report.update(steps=0, stopped="budget: step 1 and the final test would exceed it", history=[], learning=[],
                  candidates=[], choice=None, test=[], usage={}, timings={})
    del report["promotion"]
    found = sections(write_html(report, tmp_path / "report.html").read_text())
    assert list(found) == list(SECTIONS)
    assert all("none" in html for name, html in found.items() if name != "usage")
    # a report from before the candidates record says so
    del report["candidates"]
    assert "none recorded" in sections(write_html(report, tmp_path / "old.html").read_text())["candidates"]


def test_a_failure_to_draw_is_one_warning_line_in_the_run(tmp_path, monkeypatch):
    from pipelines import loop, run_report

    def broken(report, out):
        raise ValueError("no figure\nsecond line")

    monkeypatch.setattr(run_report, "write_html", broken)
    lines = []
    loop._write_page(REPORT, tmp_path, lines.append)  # what the loop calls once report.json is written
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0].startswith("warning: report.html not written")
    assert f"tune-prompts report {tmp_path}" in lines[0] and not (tmp_path / "report.html").exists()


def test_headless_chromium_renders_the_page(tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it where it can)")
    from PIL import Image

    page = write_html(REPORT, tmp_path / "report.html")
    png = tmp_path / "page.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1200,2000",
                    page.as_uri()], capture_output=True, timeout=120, check=True)
    image = Image.open(png).convert("RGB")
    assert image.size == (1200, 2000)
    colours = image.getcolors(maxcolors=1 << 20)
    non_white = sum(n for n, rgb in colours if min(rgb) < 240)
    assert len(colours) > 50 and non_white > 0.02 * 1200 * 2000  # text, tables and the figures' lines drawn


@pytest.mark.parametrize("case", ["missing", "no report", "corrupt", "not a report", "wrong shape", "a file"])
def test_report_errors_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, case):
    run_dir = tmp_path / "run"
    if case != "missing":
        run_dir.mkdir()
    contents = {"corrupt": '{"task": "risk", "history": [SECRET', "not a report": '["SECRET"]',
                "wrong shape": json.dumps({"task": "risk", "history": {"SECRET": 1}})}
    if case in contents:
        (run_dir / "report.json").write_text(contents[case])
    if case == "a file":
        run_dir.rmdir()
        run_dir.write_text("SECRET")
    before = sorted(tmp_path.rglob("*"))
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and str(run_dir) in err
    assert "SECRET" not in err and "rerun with --debug" not in err
    assert sorted(tmp_path.rglob("*")) == before


def test_report_writes_the_page_to_out(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "report.json").write_text(json.dumps(REPORT))
    assert main(["report", str(run_dir), "--out", str(tmp_path / "page.html")]) == 0
    assert capsys.readouterr().out == f"report: {tmp_path / 'page.html'}\n"
    assert list(sections((tmp_path / "page.html").read_text())) == list(SECTIONS)
    assert not (run_dir / "report.html").exists()
    assert main(["report", str(run_dir), "--out", str(tmp_path / "no" / "page.html")]) == 2
    assert "does not exist" in capsys.readouterr().err
