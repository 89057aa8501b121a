"""Reading task and template files: a built-in task by name or a task file by path, the limits a settings file must
keep (size, nesting, plain YAML only), paths inside installed packages, and the one-line errors that name a file
and its fix. What a task may say, and its validation, is the schema in ``pipelines/config.py``.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Hashable
from pathlib import Path

import yaml

from pipelines.config import ConfigError, TaskConfig, TemplateConfig, excerpt, parse_task, unknown_keys
from templates.template import Template, TemplateError, constraints_from_spec

BUILTIN_TASKS_DIR = Path(__file__).parent / "tasks"
MAX_TASK_FILE_BYTES = 2**20  # a task or template file is settings, never this big
MAX_TASK_FILE_DEPTH = 32  # nesting of a task file: a task is 3 deep, an output contract's JSON schema a few more
# a top-level key as a task, template or template-record file writes it; anything else shows a file of another kind
_SETTING_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")
# the explicit tags a settings file may carry: plain scalars and the two containers (!!binary, !!set, !!timestamp,
# !!omap and !!python/... build objects no setting takes)
_PLAIN_TAGS = {f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "map", "seq")}


def builtin_tasks() -> list[str]:
    return sorted(p.stem for p in BUILTIN_TASKS_DIR.glob("*.yaml"))


def load_task(name_or_path: str | Path) -> TaskConfig:
    """A built-in task by name (``risk``) or a user's task file by path."""
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        if str(name_or_path) not in builtin_tasks():
            raise ConfigError(
                f"unknown task {excerpt(str(name_or_path))}: built-in tasks are {', '.join(builtin_tasks())}; "
                "or pass the path of a task YAML file"
            )
        path = BUILTIN_TASKS_DIR / f"{name_or_path}.yaml"
    data = load_yaml_mapping(path, "task file")
    base_dir = path.resolve().parent
    if isinstance(data.get("template"), str):  # the template section may live in its own file
        template_path = resolve_source(data["template"], base_dir)
        data["template"] = load_yaml_mapping(template_path, "template file")
        unknown = [key for key in data["template"] if key not in TemplateConfig.model_fields]
        if unknown:
            raise ConfigError(f"template file {excerpt(template_path.name)} has "
                              f"{unknown_keys(unknown, TemplateConfig.model_fields)}")
    return parse_task(data, base_dir, f"task file {excerpt(str(path))}")


class _TaskFileLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases, tags other than plain ones, nesting deeper than MAX_TASK_FILE_DEPTH and
    duplicate keys. An alias expands without bound (a 2 KB 'billion laughs' file becomes gigabytes) and no task
    needs one; a tag builds bytes, sets or dates no setting takes; deep nesting is recursion; a duplicate key
    would silently keep the last value."""

    depth = 0

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.MarkedYAMLError(problem="aliases (*name) are not allowed in task files; write the value out",
                                       problem_mark=event.start_mark)
        tag = getattr(event, "tag", None)
        if tag not in (None, "!") and tag not in _PLAIN_TAGS:  # not echoed: a tag is the file's own text
            raise yaml.MarkedYAMLError(problem="YAML tags such as !!binary, !!set or !!python/... are not allowed in "
                                       "task files; write a plain value", problem_mark=event.start_mark)
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if self.depth >= MAX_TASK_FILE_DEPTH:
                raise _TooDeep()
            self.depth += 1
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, Hashable) and key in seen:
                raise yaml.MarkedYAMLError(problem=f"duplicate key {excerpt(key, 40)}; keep one of them",
                                           problem_mark=key_node.start_mark)
            seen.add(key)  # an unhashable key is the constructor's error to report
        return super().construct_mapping(node, deep)


def check_file(path: Path, what: str, max_bytes: int) -> None:
    """Refuse, before reading, a path that is not a regular, non-empty file of at most ``max_bytes``:
    a folder, a FIFO or a device would block or never end, and /proc files say they are empty."""
    name = excerpt(str(path))
    try:
        size = path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(f"{what} {name} does not exist; check the path") from None
    except (OSError, ValueError) as exc:  # no permission, a link loop, an over-long name, a NUL byte
        raise ConfigError(f"{what} {name} cannot be read ({type(exc).__name__}); check the path") from None
    if not path.is_file():
        raise ConfigError(f"{what} {name} is not a regular file (a folder, pipe or device); give a file's path")
    if size == 0:
        raise ConfigError(f"{what} {name} is empty (or a /proc file); give a file with content")
    if size > max_bytes:
        raise ConfigError(f"{what} {name} is {size / 2**20:.0f} MB, over the limit of {max_bytes / 2**20:.0f} MB; "
                          "give a smaller file")


class _TooDeep(Exception):
    """A task file nested deeper than MAX_TASK_FILE_DEPTH."""


def load_yaml_mapping(path: Path, what: str) -> dict:
    """A settings file (task, template section, template record) as a mapping; every refusal is one line that
    names the file but shows nothing of what it holds beyond a line number (a file of another kind, such as
    /etc/shadow, must not come back in an error)."""
    check_file(path, what, MAX_TASK_FILE_BYTES)
    name = excerpt(str(path))
    try:
        loader = _TaskFileLoader(path.read_bytes().decode("utf-8"))
        try:
            node = loader.get_single_node()
            _check_settings_node(node, f"{name} is not a {what}")
            data = loader.construct_document(node)
        finally:
            loader.dispose()
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {name} is not UTF-8 text; save it as UTF-8") from None
    except yaml.MarkedYAMLError as exc:
        where = f"line {exc.problem_mark.line + 1}: " if exc.problem_mark else ""
        problem = " ".join(str(exc.problem).split())[:200]
        raise ConfigError(f"{what} {name} is not valid YAML: {where}{problem}; fix the YAML") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what} {name} is not valid YAML ({type(exc).__name__}); fix the YAML") from None
    except (_TooDeep, RecursionError):
        raise ConfigError(f"{what} {name} is nested too deep to be settings (over {MAX_TASK_FILE_DEPTH} levels); "
                          "flatten it") from None
    return data


def _check_settings_node(node, not_settings: str) -> None:
    """Refuse a document that is not a mapping of ``key: value`` lines with setting-like keys, naming only the line."""
    if not isinstance(node, yaml.MappingNode):
        line = 1 if node is None else node.start_mark.line + 1
        raise ConfigError(f"{not_settings} (line {line} is not `key: value`); give a YAML file of settings")
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or not _SETTING_KEY.fullmatch(key.value):
            raise ConfigError(f"{not_settings} (line {key.start_mark.line + 1} is not `key: value`); give a YAML file "
                              "of settings")


def resolve_source(source: str, base_dir: Path) -> Path:
    """A path relative to ``base_dir`` (the task file's folder), an absolute path, or ``package:<pkg>/<path>``:
    a file inside an installed package, found without importing it, that must stay inside the package."""
    if source.startswith("package:"):
        package, _, inner = source[len("package:") :].partition("/")
        # only a top-level name: find_spec("a.b") would import a
        spec = importlib.util.find_spec(package) if package.isidentifier() else None
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(f"source {excerpt(source)}: {excerpt(package)} is not an installed package; "
                              "give package:<package>/<path> of an installed one (scripts/setup.sh installs them)")
        root = Path(spec.submodule_search_locations[0]).resolve()
        path = (root / inner).resolve()
        if not path.is_relative_to(root):
            raise ConfigError(f"source {excerpt(source)} leads outside package {package!r}; "
                              "give a path inside the package, without '..'")
        return path
    path = Path(source)
    return path if path.is_absolute() else base_dir / path


def read_template_file(path: str, task: TaskConfig) -> Template:
    """A template from a file: YAML record (text, variables, constraints, decision) or plain template text.

    The task's constraints on its input hold for a template from a file too; a record's own constraints add to them.
    """
    file, name = Path(path), excerpt(path)
    if file.suffix in (".yaml", ".yml"):
        template = Template.from_dict(load_yaml_mapping(file, "template file"))
    else:
        check_file(file, "template file", MAX_TASK_FILE_BYTES)
        try:
            text = file.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"template file {name} is not UTF-8 text (byte {exc.start} is not valid UTF-8): "
                              "save it as UTF-8") from None
        template = Template.from_text(text.rstrip("\n"))
    if set(template.variables) != set(task.input_variables):
        wanted = ", ".join("{" + v + "}" for v in task.input_variables)
        declared = template.variables[:5] + (("...",) if len(template.variables) > 5 else ())
        raise TemplateError(f"template in {name} declares {len(template.variables)} variable(s) {list(declared)}; "
                            f"task {task.name!r} fills {wanted}")
    task_constraints = tuple(constraints_from_spec(task.template.constraints))
    return Template(template.text, template.variables, tuple(dict.fromkeys(task_constraints + template.constraints)),
                    template.decision)
