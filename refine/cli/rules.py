"""`refine rules ...`: the rule authors' kit (refine/kit/rulebook.py does the work), and the `--rules`
option every command shares, whose callback warns about typos in the user's rule files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from refine.kit import rulebook
from refine.cli.common import fail as _fail
from refine.errors import InputError


def warn_rule_typos(value: Optional[list[Path]]) -> Optional[list[Path]]:
    """The --rules callback: one stderr line per body predicate of a user rule file that nothing
    defines (`pairr` for `pair`), once per command (the option is parsed once, and a batch's
    workers never print it). A bad directory or rule file is left to the command to report."""
    if value:
        try:
            for line in rulebook.typo_warnings(value):
                typer.echo(f"refine: warning: {line}", err=True)
        except InputError:
            pass
    return value


RulesOpt = Annotated[Optional[list[Path]], typer.Option("--rules", callback=warn_rule_typos,
                                                        help="extra directory of .lp lemma files (repeatable)")]
JsonFlag = Annotated[bool, typer.Option("--json", help="print JSON instead of text (machine output)")]

rules_app = typer.Typer(no_args_is_help=True, add_completion=False, help=(
    "For rule authors: the lemmas of the library and of your --rules files, the ops of a model "
    "that no rule file handles, and your lemmas checked on numbers (docs/first-lemma.md)."))


@rules_app.command("list")
def list_lemmas(
    op: Annotated[Optional[str], typer.Option("--op", help="only the lemmas for this ONNX op type (case-insensitive; "
                                                           "AllReduce finds dist.AllReduce)")] = None,
    rules: RulesOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Every lemma: where it is, its name, its ops and the identity it encodes.

    A lemma is a `rel_by(..., name)` rule; its identity is the comment above it; its ops are those
    its body names (or its helper predicates, or its file's handles/2). Exit 1 if --op matches none."""
    try:
        inv = rulebook.inventory(rules)
    except InputError as exc:
        _fail(exc, (rules or [Path(".")])[0])
    if op is not None:
        inv.lemmas = inv.for_op(op)
    if as_json:
        typer.echo(inv.model_dump_json(indent=1))
    else:
        for lemma in inv.lemmas:
            typer.echo(rulebook.render_lemma(lemma))
        user = sum(lemma.user for lemma in inv.lemmas)
        count = f"{len(inv.lemmas)} lemma rule{'s' if len(inv.lemmas) != 1 else ''}" if inv.lemmas else "no lemma"
        typer.echo(count + (f" for op {op}" if op is not None else "") + (f" ({user} from --rules)" if rules else ""))
    raise typer.Exit(1 if op is not None and not inv.lemmas else 0)


@rules_app.command("coverage")
def coverage(
    models: Annotated[list[Path], typer.Argument(help="model directories (seq.onnx, rank*.onnx, refine.json) or .onnx files")],
    rules: RulesOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """The op types of the models that no rule file handles, with node counts.

    Most nodes first (local functions included), then how many are handled. Handled: named by a
    `handles/2` fact of a rule file, or by a lemma's body. Exit 2 if a model does not load."""
    try:
        cov = rulebook.coverage(models, rules)
    except InputError as exc:
        _fail(exc, models[0])
    print_coverage(cov, as_json)


@rules_app.command("check")
def check(
    rules_dir: Annotated[Path, typer.Argument(help="directory of .lp lemma files (and example model directories) to check")],
    save: Annotated[Path, typer.Option("--save", help="where to write each instance on which a relation does not hold "
                                                      "(a model directory per instance; written only then)")] = Path("refine-rules-check"),
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="random instances per op and world size")] = 2,
    as_json: JsonFlag = False,
) -> None:
    """Check the lemmas of DIR on numbers before trusting them.

    For every op they handle: instances with random shapes, the op's float inputs declared in
    every combination of replicated, sharded on each axis and partial sums, on 2 and 3 ranks;
    and every model directory inside DIR. Each is solved with the bundled lemmas and DIR's, run
    on the multi-rank simulator, and every derived relation is checked. Exit 1 if one does not
    hold (its instance saved under --save), 0 if all held."""
    from refine.kit import rulecheck
    from refine.report.render import rule_check_lines

    try:
        result = rulecheck.check_rules(rules_dir, tuple(range(seeds)), save)
    except InputError as exc:
        _fail(exc, rules_dir)
    if as_json:
        typer.echo(result.model_dump_json(indent=1))
    else:
        for line in rule_check_lines(result, f"rules check {rules_dir}", limit=10):
            typer.echo("".join(text for text, _style in line))
        for tally in result.lemmas:
            typer.echo(f"  {tally.lemma}: fired on {tally.fired} instance(s), {tally.held} relation(s) held, "
                       f"{tally.violated} did not")
        if result.not_exercised:
            typer.echo(f"  not exercised (no instance made them fire; add an example model directory): "
                       f"{', '.join(result.not_exercised)}")
        for reason in result.unsupported_ops[:10]:
            typer.echo(f"  no generated instances: {reason}")
        for rule in result.unstratified:
            typer.echo(f"  not stratified (slow to ground; docs/facts.md, 'Adding a lemma'): {rule}")
    raise typer.Exit(1 if result.status == "violated" else 0)


@rules_app.command("without")
def without(
    lemmas: Annotated[list[str], typer.Argument(help="lemma names (as `refine rules list` prints them)")],
    out: Annotated[Path, typer.Option("--out", help="directory to write the library into")] = Path("refine-library"),
) -> None:
    """Write the bundled library with some lemmas left out, to see what refine says without them:
    `REFINE_LIBRARY=OUT refine verify DIR` (and `refine rules suggest DIR` to propose one instead).
    A name that is no lemma of the library: one line, exit 2, nothing written."""
    try:
        found = rulebook.library_without(lemmas, out)
    except InputError as exc:
        _fail(exc, out)
    typer.echo(f"{out}: the library without {', '.join(found)}; use it with REFINE_LIBRARY={out}")


@rules_app.command("suggest")
def suggest(
    model: Annotated[Path, typer.Argument(help="an UNPROVEN model directory (seq.onnx, rank*.onnx, refine.json)")],
    out: Annotated[Path, typer.Option("--out", help="where to write the candidate lemma and its witness model "
                                                    "directory")] = Path("refine-suggested"),
    seeds: Annotated[int, typer.Option("--seeds", min=1, help="simulations the relation must hold on")] = 3,
    rules: RulesOpt = None,
    as_json: JsonFlag = False,
) -> None:
    """Propose a lemma for an UNPROVEN verdict, from the numbers.

    At the first node the lemmas could not get past, the rank output is compared with the
    sequential one on several simulations, under every layout refine knows made from the inputs'.
    One that holds on every rank and seed is written as a lemma (with the identity it claims) to
    --out, checked with `refine rules check`, and the model verified with it; you adopt it with
    `refine verify MODEL --rules OUT`. Exit 0 when one is proposed, 1 when none holds (or `rules
    check` refutes it), 2 on bad input."""
    from refine.kit import suggest as suggesting

    try:
        found = suggesting.suggest(model, out, rules, tuple(range(seeds)))
    except InputError as exc:
        _fail(exc, model)
    if as_json:
        typer.echo(found.model_dump_json(indent=1))
    else:
        typer.echo(f"{found.status}: {found.summary}")
        if found.lemma:
            typer.echo("")
            typer.echo(found.lemma)
        if found.check is not None:
            typer.echo(f"rules check: {found.check.status}: {found.check.summary}")
        if found.witness_note:
            typer.echo(f"no witness model directory for {found.witness_note}")
        if found.verdict_with_it:
            typer.echo(f"{model} with it: {found.verdict_with_it}")
        if found.status == "proposed":
            typer.echo(f"adopt it: {found.command}")
    raise typer.Exit(0 if found.status in ("proposed", "not_unproven") else 1)


def print_coverage(cov: rulebook.Coverage, as_json: bool = False) -> None:
    typer.echo(cov.model_dump_json(indent=1) if as_json else rulebook.render_coverage(cov))


def print_batch_coverage(root: Path, plan_tp: int | None, rules: list[Path] | None) -> None:
    """`refine batch --coverage`: the coverage summed over the batch's entries, after its table."""
    typer.echo("")
    try:
        print_coverage(rulebook.batch_coverage(root, plan_tp, rules))
    except InputError as exc:
        _fail(exc, root)
