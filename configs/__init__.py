"""Data shipped with batchsim (model shapes, Macs, workloads, device profiles, trace slices) and the
strict YAML -> frozen dataclass loader every config file goes through."""

from __future__ import annotations

import dataclasses
import functools
import re
import stat
import types
import typing
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin

import yaml

CONFIG_DIR = Path(__file__).resolve().parent

T = TypeVar("T")


def _written_at(node: yaml.MappingNode, j: int) -> yaml.Mark | None:
    """Where the mapping's pair `j` is written: its key's mark, or its value's where the key is an
    alias (`*x : 1`: the same node as its anchor, whose mark is the anchor's); None if both are."""
    floor = max([node.start_mark.index]
                + [n.end_mark.index for pair in node.value[:j] for n in pair])
    for part in node.value[j]:  # an alias starts before the pair: where its anchor is
        if part.start_mark.index >= floor:
            return part.start_mark
    return None


def _flatten_unique(self: Any, node: yaml.MappingNode) -> None:
    """A mapping's keys checked before its merges (`<<: *base`, which may repeat a key on purpose)
    are flattened into it: a key written twice was read as its last value, silently. Keys are
    compared as read (`16` and `0x10`, `true` and `yes`, `~` and `null` are one key), not as
    written; a quoted "16" stays a string, another key than 16. By position, not by node: an
    alias (`&x k : 1` then `*x : 2`) is the same node as its anchor."""
    checked = self.__dict__.setdefault("_unique_checked", set())
    if id(node) not in checked:  # a node merged again was flattened already
        checked.add(id(node))
        first: dict[Any, int] = {}
        for j, (key, _) in enumerate(node.value):
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                i = first.setdefault(self.construct_object(key), j)
                if i != j:
                    mark = _written_at(node, i)
                    where = f"on line {mark.line + 1}" if mark else f"as key {i + 1} of its mapping"
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key.value[:60]!r} is given twice (first "
                        f"{where}); keep one", _written_at(node, j))
    yaml.constructor.SafeConstructor.flatten_mapping(self, node)


def _yaml12_floats(base: type) -> type:
    """`base`, except that `1e-3` is a float as in YAML 1.2 and JSON (YAML 1.1 reads it as a
    string, and `request_rate: 1e-3` was refused as "expected a number, got '1e-3'"), and a key
    given twice in one mapping is an error (_flatten_unique)."""
    loader = type(f"Batchsim{base.__name__}", (base,), {"flatten_mapping": _flatten_unique})
    loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
        list("-+0123456789"),
    )
    return loader


# PyYAML's pure-Python parser decides (its values, its errors: the line and a caret); libyaml's
# (8x faster: macs.yaml 66 -> 8 ms, read on every `batchsim run`) reads the files where the two
# agree: no tab in the text (libyaml takes `key:<TAB>5`, PyYAML refuses it) and no error.
_PureLoader = _yaml12_floats(yaml.SafeLoader)
_Loader = _yaml12_floats(yaml.CSafeLoader) if yaml.__with_libyaml__ else _PureLoader

_TOO_DEEP = "exceeded maximum nesting depth"  # libyaml's words for [[[...]]] past 1,000 levels
MAX_YAML_VALUES = 1_000_000  # values, lists and mappings, counted once per alias to them
# Lists and mappings within each other (shipped files: 5). PyYAML's parser recursed past Python's
# stack at 330-600 levels, libyaml's stops at 1,000 (none before 0.2.5): each build refuses past
# this, before a check prints the whole value in one line.
MAX_YAML_DEPTH = 100
_NESTED = f"not valid YAML: nested too deeply to read (more than {MAX_YAML_DEPTH} levels)"


def _parse_yaml(text: str) -> Any:
    if _Loader is _PureLoader or "\t" in text:
        return _pure_yaml(text)
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        if _TOO_DEEP in str(exc):
            raise
        _pure_yaml(text)  # its message: the line and a caret (libyaml's names neither)
        raise  # a "\ud800" escape: PyYAML reads it (half a character), libyaml refuses


def _pure_yaml(text: str) -> Any:
    data = yaml.load(text, Loader=_PureLoader)
    if ("\\u" in text or "\\U" in text) and _has_lone_surrogate(data):  # a traceback later, as
        raise yaml.YAMLError("a \\ud800-\\udfff escape is half a character")  # text is written
    return data


def _has_lone_surrogate(data: Any) -> bool:
    stack, seen = [data], set()
    while stack:
        node = stack.pop()
        if isinstance(node, str) and any("\ud800" <= c <= "\udfff" for c in node):
            return True
        if isinstance(node, (dict, list)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend([*node.keys(), *node.values()] if isinstance(node, dict) else node)
    return False


def _expanded_values(data: Any) -> tuple[int, int]:
    """How many values, lists and mappings `data` holds once each alias is expanded into a copy
    (a 12-line YAML of aliases of aliases holds 10**12), and how deep lists and mappings nest;
    a cycle counts once."""
    sizes: dict[int, tuple[int, int]] = {}
    stack: list[tuple[Any, bool]] = [(data, False)]
    while stack:
        node, children_done = stack.pop()
        if not isinstance(node, (dict, list)):
            continue
        items = list(node.values() if isinstance(node, dict) else node)
        children = [c for c in items if isinstance(c, (dict, list))]
        if children_done:
            total = 1 + len(items) - len(children) + sum(sizes[id(c)][0] for c in children)
            depth = 1 + max((sizes[id(c)][1] for c in children), default=0)
            sizes[id(node)] = (min(total, MAX_YAML_VALUES + 1), depth)
        elif id(node) not in sizes:
            sizes[id(node)] = (1, 1)  # until its children are counted: a cycle back to it counts 1
            stack.append((node, True))
            stack.extend((c, False) for c in children)
    return sizes.get(id(data), (0, 0))


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message names the file and the key."""


def file_kind(path: Path) -> str:
    """What a path that is there but no regular file is: 'a directory', 'a pipe', ..."""
    mode = path.stat().st_mode
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a pipe"),
             (stat.S_ISSOCK, "a socket"))
    return next((name for test, name in kinds if test(mode)), "not a file")


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{path}: no such file")
    if not path.is_file() and file_kind(path) != "a pipe":  # <(...) is one; /dev/zero filled
        raise ConfigError(f"{path}: is {file_kind(path)}, not a YAML file")  # the memory
    try:
        data = _parse_yaml(path.read_text())
    except yaml.YAMLError as exc:
        if _TOO_DEEP in str(exc):  # libyaml's limit, before Python's RecursionError below
            raise ConfigError(f"{path}: {_NESTED}") from None
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:  # unreadable, or not text
        raise ConfigError(f"{path}: cannot be read as YAML: {exc}") from None
    except RecursionError:  # `[[[...]]]` 100,000 deep was a RecursionError traceback
        raise ConfigError(f"{path}: {_NESTED}") from None
    values, depth = _expanded_values(data)
    if values > MAX_YAML_VALUES:  # each check and message walked them all: a hang
        raise ConfigError(f"{path}: its aliases expand to more than {MAX_YAML_VALUES:,} values "
                          "(aliases of aliases); write the values out")
    if depth > MAX_YAML_DEPTH:
        raise ConfigError(f"{path}: {_NESTED}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check (and minimally convert) one value against a type hint; raise ConfigError naming
    `where`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is typing.Literal:
        if value not in get_args(tp):
            raise ConfigError(f"{where}: {value!r} is not allowed; allowed: {_type_name(tp)}")
        return value
    if origin in (Union, types.UnionType):
        return _coerce_union(value, tp, where)
    if origin in (tuple, list, dict):
        return _coerce_container(value, tp, where)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # already built (e.g. a section loaded with its own rules)
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, where)
    if tp in _SCALARS:
        return _coerce_scalar(value, tp, where)
    if isinstance(tp, type) and not isinstance(value, tp):
        raise ConfigError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


def _coerce_union(value: Any, tp: Any, where: str) -> Any:
    args = get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _coerce(value, arg, where)
        except ConfigError:
            pass
    raise ConfigError(f"{where}: {value!r} does not fit {_type_name(tp)}")


def _coerce_container(value: Any, tp: Any, where: str) -> Any:
    origin = get_origin(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        k_tp, v_tp = get_args(tp) or (Any, Any)
        return {_coerce(k, k_tp, where): _coerce(v, v_tp, f"{where}.{k}") for k, v in value.items()}
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    args = get_args(tp)
    item_tp = args[0] if args else Any
    items = [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(items) if origin is tuple else items


# type -> (accepts a YAML value, what the error says was expected)
_SCALARS: dict[type, tuple[Any, str]] = {
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    bool: (lambda v: isinstance(v, bool), "true or false"),
    str: (lambda v: isinstance(v, str), "a string"),
    float: (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
}


def _coerce_scalar(value: Any, tp: type, where: str) -> Any:
    accepts, expected = _SCALARS[tp]
    if tp is float and isinstance(value, str) and value.strip().lower() in ("inf", "infinity"):
        return float("inf")
    if not accepts(value):
        raise ConfigError(f"{where}: expected {expected}, got {value!r}")
    return float(value) if tp is float else value


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """typing.get_type_hints(cls), evaluated once per class: a simulated run read 16 classes'
    annotations 91 times (Mac's 34 of them: r1's count at 575be2e), now 16.
    Read-only."""
    return typing.get_type_hints(cls)


def from_dict(cls: type[T], data: dict[str, Any], source: str) -> T:
    """Build frozen dataclass `cls` from `data`; unknown keys, missing keys and wrong types are
    errors that name `source` (a file, or file:section) and the key, with what is allowed."""
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        listed = ", ".join(map(repr, unknown))
        named = f"key {listed}" if len(unknown) == 1 else f"keys {listed}"
        raise ConfigError(f"{source}: unknown {named}; allowed keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, field in fields.items():
        if name in data:
            kwargs[name] = _coerce(data[name], hints[name], f"{source}: {name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{source}: missing required key {name!r}")
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        msg = str(exc)  # a value the dataclass itself refuses; name the source once
        raise ConfigError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def load_dataclass(cls: type[T], path: str | Path) -> T:
    return from_dict(cls, load_yaml(path), str(path))
