"""`refine`: the command line (typer). Thin: parses arguments, calls refine.pipeline, prints.

Exit codes: 0 verified, 1 refuted or unproven, 2 bad input or usage.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from refine import pipeline
from refine.errors import InputError
from refine.report import Report, render_text, write_json

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__, pretty_exceptions_enable=False)

RulesOpt = Annotated[Optional[list[Path]], typer.Option("--rules", help="extra directory of .lp lemma files (repeatable)")]
JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="also write the report as JSON here")]


def _fail(exc: InputError) -> None:
    typer.echo(f"refine: error: {exc}", err=True)
    raise typer.Exit(2)


def _finish(report: Report, json_path: Path | None) -> None:
    typer.echo(render_text(report))
    if json_path is not None:
        write_json(report, json_path)
    raise typer.Exit(report.exit_code)


@app.command()
def lower(
    model_dir: Annotated[Path, typer.Argument(help="directory with seq.onnx, rank*.onnx, refine.json")],
    out: Annotated[Path, typer.Option("--out", help="facts directory to write")],
) -> None:
    """Lower a model directory to a facts directory (one .facts file per relation)."""
    try:
        facts = pipeline.lower_to_dir(model_dir, out)
    except InputError as exc:
        _fail(exc)
    typer.echo(f"wrote {facts.count()} facts to {out}")


@app.command()
def run(
    facts: Annotated[Path, typer.Option("--facts", help="facts directory written by `refine lower`")],
    rules: RulesOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Run the lemma library over a facts directory and print the verdict."""
    try:
        report = pipeline.run_facts_dir(facts, rules)
    except InputError as exc:
        _fail(exc)
    _finish(report, json_path)


@app.command()
def verify(
    model_dir: Annotated[Path, typer.Argument(help="directory with seq.onnx, rank*.onnx, refine.json")],
    rules: RulesOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Lower and run in one step."""
    try:
        report = pipeline.verify_dir(model_dir, rules)
    except InputError as exc:
        _fail(exc)
    _finish(report, json_path)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
