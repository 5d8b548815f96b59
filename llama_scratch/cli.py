"""What every command's command line shares: a parser that takes flags only as spelt (`--epoch 2` is no
`--epochs 2`) and tells a usage error in one line, with the nearest flag for a misspelt one; and warnings of the
package's own kinds printed as their message alone, not as Python's `file.py:433: DataWarning:` and a source line.

Only the standard library here: `llama-scratch --help` imports this without paying for torch."""

from __future__ import annotations

import argparse
import difflib
import warnings
from typing import NoReturn

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
