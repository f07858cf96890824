"""``tether config``: show a resolved recipe, or print the reference of every key."""

from __future__ import annotations

import argparse

from tether.config import load_config, reference_markdown


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show a resolved recipe or the reference of every key")
    what = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    show = what.add_parser("show", help="print a recipe with overrides applied and every default filled in")
    show.add_argument("args", nargs="*", metavar="RECIPE|KEY=VALUE")
    show.set_defaults(func=_show)
    ref = what.add_parser("reference", help="print the Markdown reference of every recipe key")
    ref.set_defaults(func=_reference)


def _show(ns: argparse.Namespace) -> int:
    from tether.cli.plan import split_recipe_args

    recipe, overrides = split_recipe_args(ns.args)
    print(load_config(recipe, overrides).to_yaml(), end="")
    return 0


def _reference(ns: argparse.Namespace) -> int:
    print(reference_markdown())
    return 0
