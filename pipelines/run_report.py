"""The run report a person reads: one self-contained HTML page drawn from a run's report.json (issue #38).

``write_html(report, out)`` writes the page, one ``<section>`` each: how the reward moved step by step
(``learning``), the candidates each step produced (``candidates``), the seed against the chosen template on the
held-out test split with counts and 95% intervals (``test``), ten sample answers of each (``samples``), the
gate's decision with every bar (``gate``), what the store recorded (``store``), and the calls, tokens and wall
time the run took (``usage``). The tuning loop writes it after report.json; ``tune-prompts report RUN_DIR``
draws it again from that file.

The page loads nothing: the figures are inline SVG, drawn with matplotlib's ``Figure`` (no pyplot, no GUI
backend, no global state; imported only when drawing, so importing the CLI stays fast), the style is inline,
and a Content-Security-Policy forbids anything else. Every string taken from the report is escaped: the
instructions and answers are model output.

The module is long because the page is one document: seven sections, their figures and the escaping every
section relies on; each section is one function, in page order.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from pathlib import Path

from pipelines.config import ConfigError

SECTIONS = {"learning": "Learning: the reward by step", "candidates": "Candidates, step by step",
            "test": "Held-out test: the seed against the chosen template", "samples": "Sample answers on test",
            "gate": "The gate", "store": "The template store", "usage": "Usage and wall time"}
# what report.json holds at its top level, by type (task and history are in every report the loop writes)
SHAPE = {"task": str, "history": list, "learning": list, "candidates": list, "test": list, "choice": (dict, type(None)),
         "promotion": dict, "usage": dict, "timings": dict}
Z95 = 1.959964  # the normal quantile of a two-sided 95% interval
STYLE = """
body { font: 14px/1.45 system-ui, 'DejaVu Sans', sans-serif; color: #1a1a1a; max-width: 1180px; margin: 1.5em auto;
       padding: 0 1em; }
h1 { font-size: 1.6em; margin-bottom: .2em; } h2 { border-bottom: 2px solid #ddd; padding-bottom: .2em; margin-top: 1.8em; }
h3 { margin: 1.2em 0 .4em; } nav a { margin-right: 1em; } .muted { color: #666; }
table { border-collapse: collapse; margin: .4em 0 1em; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 2px 5px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td:first-child { white-space: nowrap; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.text { white-space: pre-wrap; word-break: break-word; min-width: 18em; max-width: 46em; display: inline-block; }
.pass { color: #17692b; font-weight: 600; } .fail { color: #b3261e; font-weight: 600; }
.wide { overflow-x: auto; max-width: 100%; }
figure { margin: .5em 0 1em; } figure svg { max-width: 100%; height: auto; } figcaption { color: #555; font-size: 13px; }
"""


class Markup(str):
    """Text that is already HTML (made here from escaped parts): a table cell that is not escaped again."""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def fmt(value) -> str:
    """One value as HTML: numbers to 3 decimals (1 from 100 on), booleans as yes/no, missing as n/a."""
    if isinstance(value, Markup):
        return value
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        shown = f"{value:.1f}" if abs(value) >= 100 else f"{value:.3f}"
        return shown.removeprefix("-") if float(shown) == 0 else shown  # -0.000 reads as a sign that is not there
    if isinstance(value, (list, dict)):
        return esc(json.dumps(value, ensure_ascii=False))
    return esc(value)


def text(value) -> Markup:
    """Free text (an instruction, an answer): escaped, its line breaks kept."""
    return Markup(f'<span class="text">{esc(value)}</span>')


def verdict(passed) -> Markup:
    return Markup('<span class="pass">pass</span>' if passed else '<span class="fail">fail</span>')


def table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return "<p>none</p>"
    head = "".join(f"<th>{esc(c).replace('_', '_<wbr>')}</th>" for c in columns)  # long names wrap at _
    body = "".join(
        "<tr>" + "".join(f'<td{" class=num" if _is_number(row.get(c)) else ""}>{fmt(row.get(c))}</td>'
                         for c in columns) + "</tr>" for row in rows)
    return f'<div class="wide"><table><tr>{head}</tr>{body}</table></div>'


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value) -> float:
    """A value to plot: a number, else NaN (a gap in the line)."""
    return float(value) if _is_number(value) else math.nan


def wilson(kept: int, of: int) -> tuple[float, float]:
    """The Wilson score interval (95%) of a rate ``kept/of``."""
    p, z2 = kept / of, Z95 * Z95
    centre = (p + z2 / (2 * of)) / (1 + z2 / of)
    half = Z95 * math.sqrt(p * (1 - p) / of + z2 / (4 * of * of)) / (1 + z2 / of)
    return max(0.0, centre - half), min(1.0, centre + half)


def counts(value) -> tuple[int, int] | None:
    """A rate's count as the loop writes it, "33/40" -> (33, 40); None when not measured."""
    match = re.fullmatch(r"(\d+)/(\d+)", str(value or ""))
    return (int(match[1]), int(match[2])) if match and int(match[2]) else None


def components(report: dict) -> list[str]:
    """The reward components the steps logged (``reward/<name>/mean``), in their order."""
    names = {}
    for row in report.get("history") or []:
        names.update({key.split("/")[1]: None for key in row if re.fullmatch(r"reward/[^/]+/mean", key)})
    names.pop("total", None)
    return list(names)


def bar_rows(bars) -> list[dict]:
    """The gate's reasons ("fail: latency_p95_ms 224.6 > 210 (...)") as rows: result, bar, value and threshold."""
    rows = []
    for reason in bars or []:
        result, _, body = str(reason).partition(": ")
        if result not in ("pass", "fail"):
            result, body = "", str(reason)
        match = re.match(r"(paired bootstrap|[A-Za-z][\w/.-]*)(?::\s+|\s+(?=[-+\d]|nan|inf|over))(.*)$", body, re.S)
        name, rest = (match[1], match[2]) if match else ("", body)
        rows.append({"result": verdict(result == "pass") if result else "", "bar": name, "value and threshold": rest})
    return rows


def bars_html(bars) -> str:
    """The gate's reasons as a table of bars, or as plain lines where none is a bar (e.g. "no valid candidate")."""
    rows = bar_rows(bars)
    if any(row["result"] for row in rows):
        return table(rows, ["result", "bar", "value and threshold"])
    return "<ul>" + "".join(f"<li>{esc(reason)}</li>" for reason in bars or []) + "</ul>" if rows else "<p>none</p>"


# --- figures ----------------------------------------------------------------------------------
def _svg(fig) -> Markup:
    """A matplotlib figure as inline SVG: no XML prolog, no metadata, text as text (small, selectable)."""
    out = io.StringIO()
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None, "Format": None,
                                                                   "Type": None})
    svg = out.getvalue()
    return Markup(svg[svg.index("<svg"):])


def _figure(name: str, caption: str, draw, *size) -> str:
    """One figure: ``draw(fig)`` on a new ``Figure`` of ``size`` inches, as a <figure> with its caption."""
    import matplotlib
    from matplotlib.figure import Figure

    # text stays text (svg.fonttype none), no $...$ maths from component names, ids salted per figure so that
    # several SVGs in one page never share one
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": name, "text.parse_math": False,
                                "font.size": 9, "axes.spines.top": False, "axes.spines.right": False}):
        fig = Figure(figsize=size)
        draw(fig)
        svg = _svg(fig)
    return f'<figure id="fig-{esc(name)}">{svg}<figcaption>{esc(caption)}</figcaption></figure>'


def _learning_rows(report: dict) -> list[dict]:
    rows = report.get("learning") or []
    if rows or not report.get("history"):
        return rows
    return [{"step": i + 1, "mean_reward": h.get("reward/total/mean"), "best_so_far": h.get("train/best_reward"),
             "feasible_fraction": h.get("train/feasible_fraction"), "valid_fraction": h.get("train/valid_fraction")}
            for i, h in enumerate(report["history"])]


def reward_figure(rows: list[dict]) -> str:
    def draw(fig):
        ax = fig.subplots()
        steps = [r["step"] for r in rows]
        for i, row in enumerate(rows):  # each sample, feasible ones (every promotion threshold met) apart
            samples = row.get("samples") or {}
            rewards, feasible = samples.get("rewards") or [], samples.get("feasible") or []
            for ok, colour in ((False, "#9aa7b8"), (True, "#2e9d4a")):
                ys = [y for y, f in zip(rewards, feasible or [False] * len(rewards)) if bool(f) == ok and _is_number(y)]
                xs = [row["step"] + 0.12 * math.sin(1.7 * k + i) for k in range(len(ys))]
                label = None if i else ("each sample, meeting every threshold" if ok else "each sample")
                ax.scatter(xs, ys, s=14, color=colour, alpha=0.6, linewidths=0, label=label, zorder=2)
        ax.plot(steps, [_num(r.get("mean_reward")) for r in rows], marker="o", color="#1f5fa8", lw=2,
                label="mean of the step's samples", zorder=3)
        ax.plot(steps, [_num(r.get("best_so_far")) for r in rows], marker="s", color="#d4751a", lw=2, ls="--",
                label="best so far (what the policy improves on)", zorder=3)
        ax.set_xticks(steps)
        ax.set_xlabel("step")
        ax.set_ylabel("reward (weighted sum of the components)")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8, frameon=False)

    return _figure("reward", "The reward by step: each sample the policy drew, their mean, and the best so far.",
                   draw, 7.5, 3.6)


def components_figure(report: dict, rows: list[dict], names: list[str]) -> str:
    history = report.get("history") or []

    def draw(fig):
        left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
        steps = list(range(1, len(history) + 1))
        for name in names:
            left.plot(steps, [_num(h.get(f"reward/{name}/mean")) for h in history], marker="o", label=name)
        left.set_title("mean of each reward component", fontsize=9)
        if names:
            left.legend(fontsize=7, frameon=False, loc="best")
        right.plot([r["step"] for r in rows], [_num(r.get("feasible_fraction")) for r in rows], marker="o",
                   label="feasible (every threshold met)")
        right.plot([r["step"] for r in rows], [_num(r.get("valid_fraction")) for r in rows], marker="s", ls="--",
                   label="valid template")
        right.set_ylim(-0.05, 1.05)
        right.set_title("share of the step's samples", fontsize=9)
        right.legend(fontsize=7, frameon=False, loc="best")
        for ax in (left, right):
            ax.set_xticks(steps)
            ax.set_xlabel("step")
            ax.grid(alpha=0.3)

    return _figure("components", "Per step, each reward component's mean over the samples, and the share of "
                   "samples that were valid and that met every promotion threshold.", draw, 10, 3.4)


def test_figure(measures: list[tuple[str, list[tuple[str, float, tuple[float, float]]]]]) -> str:
    """``measures``: (measure, [(template, value, (low, high))]) for those with an interval."""
    def draw(fig):
        ax = fig.subplots()
        colours = {"seed": "#9aa7b8", "chosen": "#1f5fa8"}
        for y, (measure, points) in enumerate(measures):
            for k, (name, value, (low, high)) in enumerate(points):
                offset = 0.15 * (k - (len(points) - 1) / 2)
                ax.errorbar([value], [y + offset], xerr=[[value - low], [high - value]], fmt="o", capsize=3,
                            color=colours.get(name, "#d4751a"), label=name if y == 0 else None)
        ax.set_yticks(range(len(measures)), [m for m, _ in measures])
        ax.invert_yaxis()
        lows = [low for _, points in measures for _, _, (low, _) in points]
        ax.set_xlim(max(-0.02, min(lows) - 0.1), 1.02)
        ax.set_xlabel("value on the held-out test split, with its 95% interval")
        ax.grid(axis="x", alpha=0.3)
        ax.legend(fontsize=8, frameon=False, loc="lower left")

    return _figure("test", "The seed and the chosen template on test: each figure with its 95% interval.",
                   draw, 7.5, 0.55 * len(measures) + 1.2)


def time_figure(stages: list[tuple[str, float]]) -> str:
    def draw(fig):
        ax = fig.subplots()
        ax.barh([s for s, _ in stages], [v for _, v in stages], color="#1f5fa8")
        ax.invert_yaxis()
        for y, (_, seconds) in enumerate(stages):
            ax.text(seconds, y, f" {seconds:.0f} s", va="center", fontsize=8)
        ax.set_xlabel("wall time (s)")
        ax.grid(axis="x", alpha=0.3)

    return _figure("time", "Where the wall time went, by stage (the steps' stages summed over the steps).",
                   draw, 7.5, 0.32 * len(stages) + 1.0)


# --- sections ---------------------------------------------------------------------------------
def learning_section(report: dict) -> str:
    rows = _learning_rows(report)
    if not rows:
        return "<p>none: the run stopped before its first step.</p>"
    names = components(report)
    history = report.get("history") or []
    table_rows = [{**{k: v for k, v in row.items() if k != "samples"},
                   "samples": len((row.get("samples") or {}).get("rewards") or []) or None,
                   **{name: (history[i] if i < len(history) else {}).get(f"reward/{name}/mean") for name in names}}
                  for i, row in enumerate(rows)]
    columns = ["step", "mean_reward", "best_so_far", "feasible_fraction", "valid_fraction", "samples", *names]
    return (reward_figure(rows) + components_figure(report, rows, names)
            + "<p>Per step: the mean reward of the policy's samples, the best reward so far, the shares of samples "
              "that met every promotion threshold (feasible) and that were valid templates, and each reward "
              "component's mean over the samples.</p>" + table(table_rows, columns))


def candidates_section(report: dict) -> str:
    rows = report.get("candidates")
    if rows is None:
        return ("<p>none recorded: this report.json predates the candidates record (the run's W&amp;B "
                "<code>candidates</code> table holds them).</p>")
    if not rows:
        return "<p>none: the run stopped before its first step.</p>"
    finalists = {r.get("instruction"): r.get("name") for r in (report.get("choice") or {}).get("ranking") or []
                 if r.get("name") != "seed"}
    names = components(report)
    rates = [k for k in rows[0] if k.endswith("_n")]
    invalid = lambda row: ("" if row.get("valid", True) else  # noqa: E731
                           f' <span class="fail">invalid: {esc(row.get("invalid_reasons") or "")}</span>')
    shown = [{**row, "instruction": Markup(text(row.get("instruction", "")) + invalid(row)),
              "finalist": finalists.get(row.get("instruction"), "")} for row in rows]
    shown.sort(key=lambda r: (_num(r.get("step")), -_num(r.get("total_reward")) if _is_number(r.get("total_reward"))
                              else math.inf))
    columns = ["step", "instruction", "tokens", "total_reward", *names, *rates, "finished_race", "finalist"]
    return ("<p>Every candidate the policy wrote, by step and reward (best first), with the reward components it "
            "got on the dev sample; <em>finished_race</em>: it was scored on the whole sample, not only its first "
            "slice; <em>finalist</em>: its name in the choice on the whole dev split.</p>" + table(shown, columns))


def test_section(report: dict) -> str:
    rows = report.get("test") or []
    if not rows:
        return "<p>none: the run ended before the held-out test.</p>"
    skip = {"template_name", "instruction", "template", "gate_reasons", "samples"}
    keys = list(dict.fromkeys(k for row in rows for k in row
                              if k not in skip and not k.endswith(("_n", "_ci95"))))
    names = [str(row.get("template_name")) for row in rows]
    table_rows, plotted, with_ci = [], [], []
    for key in keys:
        cells, points = {"figure": key}, []
        for name, row in zip(names, rows):
            value, interval, how = row.get(key), None, ""
            if counts(row.get(f"{key}_n")):
                kept, of = counts(row[f"{key}_n"])
                interval, how = wilson(kept, of), f"{kept}/{of}; "
            elif isinstance(row.get(f"{key}_ci95"), list) and len(row[f"{key}_ci95"]) == 2:
                interval = tuple(row[f"{key}_ci95"])
                if key not in with_ci:
                    with_ci.append(key)
            cell = fmt(value)
            if interval is not None and _is_number(value):
                cell += f' <span class="muted">({esc(how)}95% {interval[0]:.3f}&ndash;{interval[1]:.3f})</span>'
                points.append((name, float(value), interval))
            cells[name] = Markup(cell)
        table_rows.append(cells)
        if points:
            plotted.append((key, points))
    ci_note = (f"a percentile bootstrap over the test examples for {esc(', '.join(with_ci))}" if with_ci else
               "none for the gate's metric, whose per-example outcomes this report.json does not keep")
    instructions = "".join(f"<li><b>{esc(name)}</b>: {esc(row.get('instruction', ''))}</li>"
                           for name, row in zip(names, rows))
    return ((test_figure(plotted) if plotted else "")
            + f"<p>The held-out test split, which tuning never reads. Intervals are 95%: Wilson score intervals for "
              f"the rates (from their counts, kept/of), {ci_note}. The other figures have no interval: report.json "
              f"keeps no per-example data for them.</p>"
            + table(table_rows, ["figure", *names]) + f"<ul>{instructions}</ul>")


def samples_section(report: dict) -> str:
    rows = report.get("test") or []
    if not rows:
        return "<p>none: the run ended before the held-out test.</p>"
    out = []
    for row in rows:
        samples = row.get("samples") or []
        shown = [{"#": i, "input": text(s.get("input", "")), "answer": text(s.get("answer", "")),
                  "parsed": text(s.get("parsed", "")), "contract_kept": s.get("contract_kept"),
                  "decision": s.get("decision"), "label": s.get("label")} for i, s in enumerate(samples, 1)]
        out.append(f"<h3>{esc(row.get('template_name'))}: {len(samples)} answers</h3>"
                   f"<p class=muted>instruction: {esc(row.get('instruction', ''))}</p>"
                   + table(shown, ["#", "input", "answer", "parsed", "contract_kept", "decision", "label"]))
    return ("<p>The first answers of each template on the test split: the input, what the target said, what the "
            "answer contract made of it, the decision and the label.</p>" + "".join(out))


def gate_section(report: dict) -> str:
    out = []
    choice = report.get("choice")
    if choice:
        ranking = choice.get("ranking") or []
        skip = {"template", "instruction", "bars"}
        columns = list(dict.fromkeys(k for r in ranking for k in r if k not in skip))
        out.append(f"<h3>The choice on the whole dev split</h3><p><b>{esc(choice.get('verdict', ''))}</b></p>"
                   "<p>The seed and each finalist, ranked, under the gate's bars tightened by the selection's "
                   "margins, and a paired bootstrap against the seed.</p>" + table(ranking, columns))
        for r in ranking:
            out.append(f"<h4>{esc(r.get('name'))}: {esc(r.get('instruction', ''))}</h4>" + bars_html(r.get("bars")))
    else:
        out.append("<h3>The choice on the whole dev split</h3><p>none: the run made no choice.</p>")
    out.append("<h3>The gate on the held-out test split</h3>")
    tested = report.get("test") or []
    if not tested:
        out.append("<p>none: the run ended before the held-out test.</p>")
    for row in tested:
        against = "as if it had no incumbent" if row.get("template_name") == "seed" else "against the seed"
        decision = '<span class="pass">PASSES</span>' if row.get("gate_passed") else '<span class="fail">REFUSED</span>'
        out.append(f"<h4>{esc(row.get('template_name'))} ({against}): {decision}</h4>"
                   + bars_html(row.get("gate_reasons")))
    promotion = report.get("promotion")
    out.append("<h3>Against production in the store</h3>")
    if promotion:
        decision = ('<span class="pass">PROMOTED</span>' if promotion.get("promoted")
                    else '<span class="fail">not promoted</span>')
        out.append(f"<p>{decision}</p>" + bars_html(promotion.get("reasons")))
    else:
        out.append("<p>none: the run recorded nothing in a store.</p>")
    return "".join(out)


def store_section(report: dict) -> str:
    promotion = report.get("promotion")
    if not promotion:
        return "<p>none: the run wrote nothing to a store (--no-store, or it ended before the test).</p>"
    rows = [{"field": "version recorded", "value": promotion.get("version", "none (no candidate went to test)")},
            {"field": "promoted to production", "value": promotion.get("promoted")},
            {"field": "production version after the run", "value": promotion.get("production")}]
    reasons = "".join(f"<li>{esc(r)}</li>" for r in promotion.get("reasons") or [])
    return table(rows, ["field", "value"]) + f"<p>The gate's reasons:</p><ul>{reasons}</ul>"


def usage_section(report: dict) -> str:
    out = []
    usage = report.get("usage") or {}
    estimated = (report.get("estimate") or {}).get("for_steps_run") or {}
    totals = [{"role": role, **u, **{f"estimated {k}": v for k, v in (estimated.get(role) or {}).items()}}
              for role, u in (usage.get("total") or {}).items() if isinstance(u, dict)]
    if totals:
        out.append("<h3>Calls and tokens</h3><p>A call is one request a server would bill; the estimate is what the "
                   "run's plan allowed for the steps it ran (an upper bound).</p>"
                   + table(totals, list(dict.fromkeys(k for r in totals for k in r))))
        phases = [{"phase": phase, "role": role, **u} for phase, roles in (usage.get("phases") or {}).items()
                  if isinstance(roles, dict) for role, u in roles.items() if isinstance(u, dict)]
        out.append("<h4>By phase</h4>" + table(phases, ["phase", "role", "calls", "prompt_tokens", "completion_tokens"]))
    else:
        out.append("<h3>Calls and tokens</h3><p>none recorded.</p>")
    timings = report.get("timings") or {}
    history = report.get("history") or []
    stages = [("startup", timings.get("timing/startup_s"))]
    for stage in ("generate", "score", "update"):
        values = [h[f"timing/{stage}_s"] for h in history if _is_number(h.get(f"timing/{stage}_s"))]
        stages.append((f"steps: {stage}", sum(values) if values else None))
    stages += [("choice on dev", timings.get("timing/select_s")), ("test", timings.get("timing/test_eval_s"))]
    stages = [(name, float(v)) for name, v in stages if _is_number(v)]
    total = timings.get("timing/total_s")
    if _is_number(total) and stages:
        stages.append(("other (set-up, store, ...)", max(0.0, total - sum(v for _, v in stages))))
    per_step = [{"step": i, **{k.removeprefix("timing/"): v for k, v in h.items() if k.startswith("timing/")}}
                for i, h in enumerate(history, 1)]
    out.append("<h3>Wall time</h3>")
    out.append(f"<p>Total: <b>{fmt(total)} s</b> ({fmt(total / 60)} min).</p>" if _is_number(total)
               else "<p>Total: not recorded in this report.json.</p>")
    if stages:
        out.append(time_figure(stages) + table([{"stage": n, "seconds": v} for n, v in stages], ["stage", "seconds"]))
    if per_step:
        out.append("<h4>By step</h4>" + table(per_step, list(dict.fromkeys(k for r in per_step for k in r))))
    return "".join(out)


def page(report: dict) -> str:
    """The whole page, as one string."""
    sections = {"learning": learning_section, "candidates": candidates_section, "test": test_section,
                "samples": samples_section, "gate": gate_section, "store": store_section, "usage": usage_section}
    body = "".join(f'<section id="{key}"><h2>{esc(SECTIONS[key])}</h2>{draw(report)}</section>'
                   for key, draw in sections.items())
    choice = report.get("choice") or {}
    promotion = report.get("promotion")
    summary = [f"run folder <code>{esc(report.get('run_dir', ''))}</code>", f"{fmt(report.get('steps'))} steps"]
    if report.get("stopped"):
        summary.append(f"stopped early: {esc(report['stopped'])}")
    if choice.get("verdict"):
        summary.append(esc(choice["verdict"]))
    if promotion:
        recorded = ("no candidate recorded" if promotion.get("version") is None else
                    f"version {fmt(promotion['version'])} {'promoted' if promotion.get('promoted') else 'not promoted'}")
        summary.append(f"store: {recorded}; production is version {fmt(promotion.get('production'))}")
    nav = "".join(f'<a href="#{key}">{esc(key)}</a>' for key in SECTIONS)
    title = f"tune-prompts run report: {esc(report.get('task', ''))}"
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8>"
            "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:\">"
            f"<meta name=viewport content=\"width=device-width, initial-scale=1\"><title>{title}</title>"
            f"<style>{STYLE}</style></head><body><h1>{title}</h1>"
            f"<p class=muted>{' &middot; '.join(summary)}</p><nav>{nav}</nav>{body}</body></html>\n")


def write_html(report: dict, out: Path) -> Path:
    """Write the run report page of ``report`` (report.json's contents) to ``out``; returns ``out``. The page is
    drawn whole before anything is written."""
    content = page(report)
    out = Path(out)
    out.write_text(content, encoding="utf-8")
    return out


def read_report(run_dir: Path) -> dict:
    """A run folder's report.json, checked to be one; a ``ConfigError`` naming the problem and the fix otherwise
    (never the file's contents)."""
    if not run_dir.exists():
        raise ConfigError(f"run folder {run_dir} does not exist: give the folder a tuning run wrote (its --run-dir, "
                          "by default runs/<task>-<time>)")
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a folder: give a tuning run's folder (its --run-dir), which holds "
                          "report.json")
    file = run_dir / "report.json"
    if not file.is_file():
        raise ConfigError(f"{run_dir} holds no report.json: give the folder of a finished tuning run (one that "
                          f"stopped part-way continues with --resume --run-dir {run_dir})")
    try:
        report = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{file} is not UTF-8 text: it is damaged; restore it or rerun the tuning") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}): it is "
                          "damaged; restore it or rerun the tuning") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {file} ({exc.strerror}): check its permissions") from None
    if not isinstance(report, dict) or "task" not in report or "history" not in report:
        raise ConfigError(f"{file} is not a tune-prompts run report (a JSON object with 'task' and 'history'): give "
                          "the folder of a tuning run")
    for key, kind in SHAPE.items():
        if key in report and not isinstance(report[key], kind):
            raise ConfigError(f"{file} is not a tune-prompts run report: its {key!r} is a JSON "
                              f"{type(report[key]).__name__}, not what a run writes; give the folder of a tuning run")
    return report


def output_path(run_dir: Path, out: str | None) -> Path:
    """Where the page goes: ``--out``, else RUN_DIR/report.html; its folder must exist."""
    path = Path(out) if out else run_dir / "report.html"
    if path.is_dir():
        raise ConfigError(f"--out {path} is a folder: give a file name, e.g. {path / 'report.html'}")
    if not path.parent.is_dir():
        raise ConfigError(f"--out {path}: the folder {path.parent} does not exist; create it or give another path")
    return path
