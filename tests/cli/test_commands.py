"""The ``phalanx`` command line's own words (phalanx.cli.commands)."""

from __future__ import annotations

import argparse

from phalanx.cli.commands import build_parser


def test_run_help_describes_every_option() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    run = sub.choices["run"]
    options = [a for a in run._actions if a.option_strings and a.dest != "help"]
    assert {"accelerator", "num_nodes", "node_rank"} <= {a.dest for a in options}
    assert all(a.help for a in options), [a.dest for a in options if not a.help]
    text = " ".join(run.format_help().split())
    assert "start `phalanx run` once on each" in text and "0 on the node at --main-address" in text
