"""What every command's command line shares: a parser that takes flags only as spelt (`--epoch 2` is no
`--epochs 2`) and tells a usage error in one line, with the nearest flag for a misspelt one; and warnings of the
package's own kinds printed as their message alone, not as Python's `file.py:433: DataWarning:` and a source line.

Only the standard library here: `llama-scratch --help` imports this without paying for torch."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import pathlib
import typing
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

UNRECOGNIZED = "unrecognized arguments: "  # how argparse starts the message for what no argument takes


def nearest(word: str, choices: list[str]) -> str | None:
    """The choice `word` most likely stands for, or None: the one it begins (what argparse would have taken it
    for), else the closest by difflib's ratio (at least 0.6), among those it begins if several."""
    begun = [c for c in choices if c.startswith(word)]
    if len(begun) == 1:
        return begun[0]
    found = difflib.get_close_matches(word, begun or choices, n=1, cutoff=0.6)
    return found[0] if found else None


class CommandParser(argparse.ArgumentParser):
    """argparse without abbreviations, and with a usage error in one line instead of the whole usage first.

    argparse takes any unique prefix of a flag (`--epoch 2` ran as `--epochs 2`): a typo could be read as another
    flag, and a flag added later would change what an old command line means. Here a flag is typed whole; a
    misspelt one is named with the flag it is nearest to."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def flags(self) -> list[str]:
        """Every flag this parser takes, long and short."""
        return [s for action in self._actions for s in action.option_strings]

    def error(self, message: str) -> NoReturn:
        """One line on stderr and exit 2: argparse's message (or, for unknown flags, each named with the nearest
        one), then where the flags are listed."""
        if message.startswith(UNRECOGNIZED):
            message = self.unknown_flags(message.removeprefix(UNRECOGNIZED).split()) or message
        self.exit(2, f"error: {message}; see {self.prog} --help\n")

    def unknown_flags(self, words: list[str]) -> str:
        """`no flag --epoch (did you mean --epochs?)` for each word that looks like a flag; "" if none does."""
        told = []
        for word in words:
            if not word.startswith("-") or word == "-":
                continue
            flag = word.split("=", 1)[0]
            guess = nearest(flag, self.flags())
            told.append(f"no flag {flag}" + (f" (did you mean {guess}?)" if guess else ""))
        return "; ".join(told)


_PLAIN: set[type[Warning]] = set()
_python_format = warnings.formatwarning


def _format(message, category, filename, lineno, line=None) -> str:
    if issubclass(category, tuple(_PLAIN)):
        return f"warning: {message}\n"
    return _python_format(message, category, filename, lineno, line)


def plain_warnings(*categories: type[Warning]) -> None:
    """Print warnings of these categories as `warning: MESSAGE`: the message is for the user (a file's bad rows),
    and the line of our code that raised it tells them nothing. Other warnings keep Python's format. Filters are
    untouched, so `-W ignore::...` and warnings.simplefilter still silence them."""
    _PLAIN.update(categories)
    warnings.formatwarning = _format


def positive_int(text: str) -> int:
    """A flag's value that counts something (texts, tokens, steps): a whole number, at least 1 (0 would make empty
    batches or cut every text to nothing)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return int(text)


# ------------------------------------------------------------------------------------ settings objects -> flags
#
# A command's settings are one dataclass whose fields are dataclasses by concern (data, model, recipe, ...), each
# field made by `option`: its default, its help, its flag, and whether `--resume` may change it. The parser is made
# from those fields (`settings_parser`) and parses back into the same object (`parse_settings`), so a flag, its
# default and its help are written once, beside the field the code reads.


def option(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    aliases: tuple[str, ...] = (),
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    positional: bool = False,
    nargs: str | None = None,
    required: bool = False,
    negate: bool = False,
    on_resume: bool = False,
    recorded: bool = True,
) -> Any:
    """A settings field that is also a flag.

    flag: the flag's name (default: `--` and the field's name with dashes). aliases: other spellings it answers to.
    parse: what turns the typed text into the value (default: the field's type, None taken out). positional: typed
    without a flag, in the order of the fields (`metavar` names it; `nargs` "*" for any number of them). required:
    a flag that must be given. negate: a `--no-X` flag that sets the field to False (its default None: not told).
    on_resume: `--resume` may give it a new value (it changes how the run computes, saves or plans, never what it
    trains on or how). recorded: kept in the run's flags for `--resume` (False: a fact of this invocation, as
    `--resume` itself)."""
    meta = {"help": help, "flag": flag, "aliases": aliases, "metavar": metavar, "choices": choices, "parse": parse}
    meta.update(positional=positional, nargs=nargs, required=required)
    meta.update(negate=negate, on_resume=on_resume, recorded=recorded)
    return dataclasses.field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """The flag a settings field is set by."""
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def groups(settings: Any) -> list[tuple[str, Any]]:
    """(name, group) for each group of a settings object (or class), in the order they are declared."""
    return [(g.name, getattr(settings, g.name)) for g in dataclasses.fields(settings) if g.metadata.get("group")]


def group(cls: type) -> Any:
    """A field of the settings object holding one group of options (its help section is the group's name)."""
    return dataclasses.field(default_factory=cls, metadata={"group": True})


def options(group_cls: type) -> list[tuple[dataclasses.Field, type]]:
    """Each option field of a group with the type its flag parses: None taken out of an `X | None`, and X for the
    items of a `list[X]` (a positional that takes several)."""
    hints = typing.get_type_hints(group_cls)
    found = []
    for f in dataclasses.fields(group_cls):
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        kind = kinds[0]
        found.append((f, typing.get_args(kind)[0] if typing.get_origin(kind) is list else kind))  # list[X]: each an X
    return found


def settings_parser(settings_cls: type, **kwargs) -> CommandParser:
    """The command's parser, made from its settings class: a help section per group, a flag per field. The flag's
    value lands under `group.field` (dest), so `parse_settings` can put it back where it belongs."""
    parser = CommandParser(**kwargs)
    for name, group_obj in groups(settings_cls()):
        section = parser.add_argument_group(name)
        for f, kind in options(type(group_obj)):
            meta, dest = f.metadata, f"{name}.{f.name}"
            if meta["positional"]:  # argparse names a positional by its dest: "group.field", shown as its metavar
                shown = meta["metavar"] or f.name.upper()
                kind = meta["parse"] or kind
                section.add_argument(dest, metavar=shown, nargs=meta["nargs"], type=kind, help=meta["help"])
                continue
            names = [flag_of(f), *meta["aliases"]]
            if kind is bool:
                action = "store_const" if meta["negate"] else "store_true"
                extra = {"const": False} if meta["negate"] else {}
                section.add_argument(*names, dest=dest, action=action, default=f.default, help=meta["help"], **extra)
                continue
            section.add_argument(
                *names,
                dest=dest,
                type=meta["parse"] or kind,
                default=f.default,
                required=meta["required"],
                metavar=meta["metavar"] or (None if meta["choices"] else flag_of(f)[2:].replace("-", "_").upper()),
                choices=meta["choices"],
                help=meta["help"],
            )
    return parser


def parse_settings(
    settings_cls: type, argv: list[str] | None = None, check: Callable[[Any], str | None] | None = None, **kwargs
) -> Any:
    """The settings a command line gives, and in `typed` the `group.field` names of the flags typed on it (a
    resumed run takes every other one from its record). `check`: what flags must go together, as a usage error's
    message (None: they do), told as argparse tells its own."""
    parser = settings_parser(settings_cls, **kwargs)
    parsed = vars(parser.parse_args(argv))
    # A second parser whose defaults are all "absent" holds only what was typed: argparse has no other way to tell
    # `--epochs 5` from the default 5.
    quiet = settings_parser(settings_cls, **kwargs)
    for action in quiet._actions:
        action.default = argparse.SUPPRESS
    settings = settings_cls()
    for dest, value in parsed.items():
        group_name, name = dest.split(".")
        setattr(getattr(settings, group_name), name, value)
    settings.typed = frozenset(vars(quiet.parse_args(argv)))
    if check is not None and (message := check(settings)):
        parser.error(message)
    return settings


def settings_fields(settings: Any) -> list[tuple[str, dataclasses.Field, Any]]:
    """(group name, field, value) for every option of a settings object."""
    return [(name, f, getattr(g, f.name)) for name, g in groups(settings) for f in dataclasses.fields(g)]


def from_json(settings: Any, group_name: str, name: str, value: Any) -> Any:
    """A setting's value as JSON kept it, back in the field's type (a path was kept as text)."""
    kind = dict((f.name, k) for f, k in options(type(getattr(settings, group_name))))[name]
    return kind(value) if kind is pathlib.Path and value is not None else value
