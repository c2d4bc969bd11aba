"""Every `longboat <command> --flag` and ``LONGBOAT_*`` variable the doctor advises exists."""

from __future__ import annotations

import argparse
import importlib
import re
from functools import cache
from pathlib import Path

from longboat.cli import SUBCOMMANDS
from longboat.launch import options
from longboat.strategy.core import ENV_FIELDS, KNOWN_ENV_VARS
from longboat.tools import doctor

DOCS = Path(__file__).parents[2] / "docs" / "doctor.md"
#: ``longboat <command>`` and the rest of its clause (up to punctuation that ends a command)
MENTION = re.compile(r"\blongboat ([a-z][\w-]*)([^;()`|#\n]*)")
ENV_VAR = re.compile(r"\bLONGBOAT_[A-Z0-9_]+")


@cache
def parser_of(command: str) -> argparse.ArgumentParser:
    """``command``'s options, added the way ``longboat.cli.build_parser`` adds them."""
    parser = argparse.ArgumentParser(prog=f"longboat {command}")
    if command == "launch":
        options.add_arguments(parser)
    else:
        importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    return parser


def wrong_flags(command: str, words: list[str]) -> list[str]:
    """The options in ``words`` (after ``longboat command``) that ``command`` does not have.

    Reading stops at the first positional word (a script, or prose); a launched
    ``-m longboat.<command>`` goes on with that command's options."""
    actions = parser_of(command)._option_string_actions
    wrong: list[str] = []
    words = [w.strip("[]") for w in words]
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if word in ("", "..."):
            continue
        if not word.startswith("-"):
            name = word.removeprefix("longboat.")
            if command == "launch" and word != name and name in SUBCOMMANDS:
                return wrong + wrong_flags(name, words[i:])
            return wrong
        flag, inline = word.split("=", 1)[0], "=" in word
        if flag not in actions:
            wrong.append(f"longboat {command} {flag}")
        elif actions[flag].nargs != 0 and not inline:
            i += 1  # its value
    return wrong


def wrong_mentions(text: str) -> list[str]:
    """Unknown commands and options among the ``longboat <command> --flag`` mentions in
    ``text``, and ``LONGBOAT_*`` variables longboat does not read. ``longboat <word>`` is prose
    (not a command) unless ``word`` is a command or an option follows it."""
    wrong: list[str] = []
    for command, rest in MENTION.findall(text):
        words = rest.split(", ")[0].split()
        if command in SUBCOMMANDS:
            wrong += wrong_flags(command, words)
        elif words[:1] and words[0].startswith("-"):
            wrong.append(f"longboat {command}")
    known = KNOWN_ENV_VARS | set(ENV_FIELDS)
    return wrong + [v for v in ENV_VAR.findall(text) if v not in known]


def test_the_checker_finds_wrong_commands_flags_and_variables() -> None:
    assert wrong_mentions("use longboat launch --nproc-per-node 2 --bogus-flag 3 train.py") == [
        "longboat launch --bogus-flag"
    ]
    assert wrong_mentions("run longboat launch -m longboat.doctor --comm --bogus") == [
        "longboat doctor --bogus"
    ]
    assert wrong_mentions("longboat launch train.py --lr 1; longboat doctor --port=1 --json") == []
    assert wrong_mentions("see longboat frobnicate --x") == ["longboat frobnicate"]
    assert wrong_mentions("a variable longboat reads") == []
    assert wrong_mentions("export LONGBOAT_NNODES=2 LONGBOAT_NO_SUCH=1") == ["LONGBOAT_NO_SUCH"]


def test_every_fix_names_existing_commands_flags_and_variables() -> None:
    assert len(doctor.FIXES) >= 15
    wrong = {key: wrong_mentions(text) for key, text in doctor.FIXES.items()}
    assert {key: found for key, found in wrong.items() if found} == {}
    for key, text in doctor.FIXES.items():  # every field is filled in by its check
        fields = dict.fromkeys(re.findall(r"{(\w+)}", text), "x")
        assert "{" not in doctor.fix_text(key, **fields), key


def test_usage_and_docs_name_existing_commands_and_flags() -> None:
    assert wrong_mentions(doctor.__doc__ or "") == []
    assert wrong_mentions(DOCS.read_text()) == []


def test_port_fix_names_the_launchers_master_option() -> None:
    taken = doctor.FIXES["port taken"]
    assert "longboat launch --master HOST:PORT" in taken and "--master-port" not in taken
    assert "--master" in parser_of("launch")._option_string_actions
