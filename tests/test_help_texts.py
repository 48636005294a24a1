"""What `%smol?` and `smolbench ... --help` tell a new user: every option, each with a line."""

from __future__ import annotations

import argparse
import re

import pytest

from smolbench import _magicargs, cli


def _options(func: object) -> set[str]:
    parser = func.parser  # type: ignore[attr-defined]
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


def _help_section(start: str, end: str | None) -> str:
    text = _magicargs.HELP.split(start, 1)[1]
    return text if end is None else text.split(end, 1)[0]


@pytest.mark.parametrize("func, start, end", [
    (_magicargs._up_args, "%smol up", "%smol status"),
    (_magicargs._checkpoint_args, "%smol checkpoint", "%smol trust"),
    (_magicargs._cell_args, "%%smol [", "%%smol fork"),
    (_magicargs._fork_args, "%%smol fork", "%%smol episodes"),
])
def test_the_magics_help_names_every_option_each_command_takes(func: object, start: str, end: str) -> None:
    """`%smol?` is where the README sends a user for "every command": an option missing
    there (`%smol up --image`, `--ray` were) is one they can only find in the source."""
    shown = _help_section(start, end)
    missing = sorted(o for o in _options(func) if not re.search(re.escape(o) + r"\b", shown))
    assert not missing, f"{start}: options not in %smol?: {missing}"


def test_the_magics_help_says_what_ledger_n_counts() -> None:
    """`%smol ledger -n N` shows the last N nodes (one row per branch), not runs."""
    line = next(line for line in _magicargs.HELP.splitlines() if "%smol ledger" in line)
    assert "nodes" in line and "runs" not in line


def _subparsers(parser: argparse.ArgumentParser, path: str = "smolbench") -> dict[str, argparse.ArgumentParser]:
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_subparsers(sub, f"{path} {name}"))
    return found


def test_every_option_of_the_smolbench_command_has_a_help_line() -> None:
    """`smolbench serve --help` listed `--backend` with no word on it, `image build` its
    `name` and `--force`, `demo` its `--backend`; and the defaults a user needs are said."""
    parsers = _subparsers(cli.build_parser())
    bare = [f"{path}: {a.option_strings[0] if a.option_strings else a.dest}"
            for path, p in parsers.items() for a in p._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and not a.help]
    assert not bare, f"options without a help line: {bare}"
    helps = {path: " ".join(p.format_help().split()) for path, p in parsers.items()}
    assert "debian:bookworm" in helps["smolbench image build"]
    assert "default 3" in helps["smolbench cluster local"] and "default 8" in helps["smolbench cluster local"]
    assert "default 16" in helps["smolbench serve"]


def test_smol_config_lists_every_limit_in_one_column() -> None:
    """`%smol config` lines its values up: `checkpoint-limit` (16 letters) pushed its value
    out of the column the others share."""
    from smolbench.gate import limits

    lines = limits.describe().splitlines()
    assert [line.split()[0] for line in lines] == list(limits.NAMES)
    starts = {len(line) - len(line.split(None, 1)[1]) for line in lines}
    assert len(starts) == 1, lines
