"""`tune-prompts ... --help` as users read it (issue #38): every command and store subcommand, found by walking the
parser (so a command added later is covered too), exits 0 with a description and examples whose commands parse;
a default written in a help text is the one that applies; a model flag given before a command holds for it."""

import argparse
import re
import shlex

import pytest

from pipelines import cli
from pipelines.cli_flags import model_sources
from pipelines.config import Endpoint, load_task
from pipelines.engine.models import EMBEDDED
from templates.routing import DEFAULT_RAMP


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser) for the top level and every command below it, as the parser defines them."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, command in action.choices.items():
                yield from commands(command, (*path, name))


COMMANDS = dict(commands(cli.build_parser()))


def examples(parser: argparse.ArgumentParser) -> list[list[str]]:
    """The argv of each `tune-prompts ...` line of the epilog's examples."""
    lines = (parser.epilog or "").split("example", 1)[-1].splitlines()
    return [shlex.split(line, comments=True)[1:] for line in lines if line.strip().startswith("tune-prompts ")]


def test_the_walk_finds_every_command():
    assert {"tasks", "render", "eval", "check", "predict", "schedule", "store"} <= {p[0] for p in COMMANDS if p}
    assert {p[1] for p in COMMANDS if len(p) == 2} == {"list", "show", "diff", "promote", "rollback", "label", "route", "doctor"}


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "tune-prompts")
def test_help_exits_0_with_a_description_and_examples_that_parse(path, capsys):
    parser = COMMANDS[path]
    with pytest.raises(SystemExit) as exc:
        cli.main([*path, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and out.startswith("usage: tune-prompts")
    assert parser.description and " ".join(parser.description.split()) in " ".join(out.split())
    argvs = examples(parser)
    # one command a line, as written (formatter_class=argparse.RawDescriptionHelpFormatter keeps the lines)
    assert argvs and re.search(r"\nexamples?:\n  tune-prompts ", out), "give the epilog an example command"
    for argv in argvs:
        args = cli.build_parser().parse_args(argv)  # a flag that does not exist exits 2 here
        for name in ("func", "store_handler"):  # the example runs this command
            assert parser.get_default(name) in (None, getattr(args, name, None)), argv


def expanded_helps():
    """(command path, flag, help as printed, default) of every flag; a command's model flags, which have no default
    of their own, with the top level's."""
    top = {a.dest: a.default for a in COMMANDS[()]._actions}
    for path, parser in COMMANDS.items():
        for action in parser._actions:
            if action.help and action.option_strings:
                default = top.get(action.dest) if action.default is argparse.SUPPRESS else action.default
                help_text = parser._get_formatter()._expand_help(action)
                yield path, action.option_strings[-1], help_text, default


RISK_FLAGS = {"--steps", "--candidates", "--finalists", "--dev-examples"}


def test_every_number_a_help_calls_a_default_is_that_default():
    risk = load_task("risk")
    checked = set()
    for path, flag, help_text, default in expanded_helps():
        for field, number in re.findall(r"the task's ([a-z_.]+); risk: ([\d.]+)", help_text):
            value = risk
            for name in field.split("."):
                value = getattr(value, name)
            assert float(number) == value, f"{' '.join(path)} {flag}: risk's {field} is {value}, the help says {number}"
            checked.add(flag)
        if flag == "--ramp":  # no default of its own (given or not matters): the store's ramp applies
            ramp = re.search(r"\(default: ([\d.,]+)\)", help_text).group(1)
            assert tuple(map(float, ramp.split(","))) == DEFAULT_RAMP
            checked.add(flag)
            continue
        for number in re.findall(r"\(default:? (-?\d+(?:\.\d+)?)\b", help_text):
            assert isinstance(default, (int, float)) and float(number) == default, \
                f"{' '.join(path)} {flag}: the default is {default!r}, the help says {number}"
            checked.add(flag)
        if flag in RISK_FLAGS and re.search(r"\d", help_text):
            assert flag in checked, f"{flag}: a number in its help that is not the task's or the parser's default"
    assert checked >= {"--steps", "--dev-examples", "--max-concurrency", "--request-timeout", "--max-drop"}


@pytest.mark.parametrize("argv", [
    ["--max-concurrency", "6", "--target-url", "http://h/v1", "--target-model", "m", "check", "--task", "risk"],
    ["check", "--task", "risk", "--max-concurrency", "6", "--target-url", "http://h/v1", "--target-model", "m"],
    ["--max-concurrency", "5", "eval", "--task", "risk", "--target-url", "http://h/v1", "--target-model", "m",
     "--max-concurrency", "6"],  # after the command wins
])
def test_the_model_flags_hold_before_or_after_the_command(argv):
    target, judge = model_sources(cli.build_parser().parse_args(argv))
    assert target == Endpoint("http://h/v1", "m", max_concurrency=6) and judge is None


def test_without_model_flags_each_command_gets_the_top_levels_defaults():
    parser, defaults = cli.build_parser(), Endpoint("URL", "MODEL")
    for argv in (["--task", "risk"], ["eval", "--task", "risk"], ["predict", "--task", "risk", "--text", "hi"]):
        args = parser.parse_args(argv)
        assert model_sources(args) == (EMBEDDED, None)
        assert (args.api_key_env, args.request_timeout, args.top_logprobs) == (
            defaults.api_key_env, defaults.timeout_s, defaults.top_logprobs)
