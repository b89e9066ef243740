"""Render the CLI reference (docs/cli.md) from the argparse parser, so the page cannot drift.

Regenerate it with::

    python -m ckptstore.cli_docs > docs/cli.md

tests/test_docs.py fails when docs/cli.md differs from what this prints.
"""

from __future__ import annotations

import argparse
import sys

from .cli import build_parser

REGENERATE = "python -m ckptstore.cli_docs > docs/cli.md"
_WIDTH = 100  # fixed, so the page does not depend on the terminal that generated it


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=_WIDTH)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups, prefix="")
    return formatter.format_help().strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                shown = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else (action.metavar or action.dest.upper())
                name += f" `{shown}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        help_text = (action.help or "") % {"default": action.default} if action.help else ""
        if action.required and action.option_strings:
            help_text += " (required)"
        rows.append(f"| {_cell(name)} | {_cell(help_text)} |")
    if not rows:
        return []
    return ["| argument | meaning |", "|---|---|", *rows]


def render() -> str:
    parser = build_parser()
    out = [
        "# CLI reference",
        "",
        "<!-- Generated from the argparse parser in ckptstore/cli.py; do not edit by hand.",
        f"     Regenerate: {REGENERATE} -->",
        "",
        "The `ckptstore` command is installed with the package (also `python -m ckptstore.cli`). Exit status: 0 on",
        "success, 1 when `verify` finds damage, 2 on a checkpoint error (the message says what, where and what to do).",
        "",
        "```text",
        _usage(parser),
        "```",
        "",
        parser.description or "",
        "",
        *_arguments(parser),
        "",
    ]
    out += _commands(parser, "ckptstore", "##")
    return "\n".join(out).rstrip() + "\n"


def _commands(parser: argparse.ArgumentParser, prefix: str, heading: str) -> list[str]:
    """A section per subcommand of ``parser``, and a subsection per subcommand of those (``ram rm``)."""
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if sub is None:
        return []
    out: list[str] = []
    helps = {c.dest: c.help for c in sub._choices_actions}
    for name, p in sub.choices.items():
        out += [f"{heading} {prefix} {name}", "", helps.get(name) or "", ""]
        if p.description:
            out += [p.description, ""]
        out += ["```text", _usage(p), "```", "", *_arguments(p), ""]
        out += _commands(p, f"{prefix} {name}", heading + "#")
    return out


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
