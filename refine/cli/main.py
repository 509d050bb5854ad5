"""`refine`: the command line (typer). Thin: parses arguments, calls refine.pipeline, prints.

Exit codes: 0 verified, 1 refuted, 2 bad input or usage, 3 unproven.
"""

from __future__ import annotations

from collections.abc import Iterable
import sys
from pathlib import Path
from typing import Annotated, NoReturn, Optional

import typer

from refine import pipeline
from refine.cli.common import fail as _fail
from refine.cli.common import usage_error as _usage_error
from refine.cli.rules import RulesOpt, print_batch_coverage, rules_app
from refine.errors import InputError
from refine.lowering.program import TEMPLATES_DIR
from refine.report.progress import ProgressMode, progress_display
from refine.report.render import render_text
from refine.report.schema import Report, write_atomic, write_json

HELP = """Prove that a distributed model implementation refines its sequential model: every
sequential output can be rebuilt from the ranks' outputs. Where it cannot, name the first
operator where the relation breaks, its source line, and a numeric counterexample.

Exit codes: 0 verified, 1 refuted, 2 bad input or usage, 3 unproven."""

app = typer.Typer(add_completion=False, no_args_is_help=True, help=HELP, pretty_exceptions_enable=False)


def _print_version(value: bool) -> None:
    if value:
        from refine.version import __version__

        typer.echo(f"refine {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """(The options before the command.)"""


app.add_typer(rules_app, name="rules", help="For rule authors: list the lemmas (`list --op Softmax`), find the ops no rule handles (`coverage`), check your lemmas on numbers (`check`).")

JsonOpt = Annotated[Optional[Path], typer.Option("--json", help="also write the report as JSON here")]
NoMemoOpt = Annotated[bool, typer.Option("--no-memo", help="inline layer functions and verify the flat graph (docs/layers.md)")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="no progress display (as --progress none)")]
VerboseOpt = Annotated[bool, typer.Option("--verbose", "-v", help="also print the lemma internals of a failure (the closest lemma and its premises)")]
ProgressOpt = Annotated[ProgressMode, typer.Option("--progress", help="auto: a spinner on a terminal, nothing otherwise; "
                                                   "plain: one line on stderr per step (logs, CI); none")]


def _os_error(exc: OSError, fallback: Path) -> InputError:
    return InputError(exc.filename or fallback, exc.strerror or type(exc).__name__)


def _check_json_path(path: Path | None) -> None:
    """Fail before doing any work if the JSON report cannot be written where asked."""
    if path is None:
        return
    if path.is_dir() or not path.name:
        _fail(InputError(path, "is a directory; --json needs a file name"), path)
    if not path.parent.is_dir():
        _fail(InputError(path, f"cannot write the JSON report: no directory {path.parent}"), path)


def _check_out_path(path: Path | None, flag: str) -> None:
    """Fail before doing any work if a --junit/--html report cannot be written where asked."""
    if path is None:
        return
    if path.is_dir() or not path.name:
        _fail(InputError(path, f"is a directory; {flag} needs a file name"), path)
    if not path.parent.is_dir():
        _fail(InputError(path, f"cannot write the {flag[2:]} report: no directory {path.parent}"), path)


def _finish(report: Report, json_path: Path | None, junit_path: Path | None = None,
            html_path: Path | None = None, verbose: bool = False) -> NoReturn:
    """Write the requested report files (each atomically), print the text report, exit 0/1.

    Text is coloured (rich) when stdout is a terminal, plain otherwise.
    """
    from refine.report.render import print_report, render_html, render_junit

    outputs = [(json_path, "JSON", lambda p: write_json(report, p)),
               (junit_path, "JUnit", lambda p: write_atomic(p, render_junit(report))),
               (html_path, "HTML", lambda p: write_atomic(p, render_html(report)))]
    for path, what, write in outputs:
        if path is None:
            continue
        try:
            write(path)
        except OSError as exc:
            _fail(InputError(path, f"cannot write the {what} report ({exc.strerror or type(exc).__name__})"), path)
    if sys.stdout.isatty():
        print_report(report, typer.echo, color=True, verbose=verbose)
    else:
        typer.echo(render_text(report, verbose))
    raise typer.Exit(report.exit_code)


def _check_out_dir(out: Path) -> None:
    """`lower --out` replaces a facts directory, never a file or a directory of other things."""
    if out.exists() and not out.is_dir():
        _fail(InputError(out, "exists and is not a directory"), out)
    if out.is_dir():
        foreign = sorted(p.name for p in out.iterdir()
                         if not (p.is_file() and p.suffix == ".facts") and not (p.is_dir() and p.name == TEMPLATES_DIR))
        if foreign:
            _fail(InputError(out, f"exists and is not a facts directory (it holds {foreign[0]!r}); not replacing it"), out)


@app.command()
def lower(
    model_dir: Annotated[Path, typer.Argument(help="directory with seq.onnx, rank*.onnx, refine.json")],
    out: Annotated[Path, typer.Option("--out", help="facts directory to write")],
    no_memo: NoMemoOpt = False,
) -> None:
    """Lower a model directory to a facts directory (one .facts file per relation; layer
    templates, if the model has layer functions, in templates/T<k>/)."""
    _check_out_dir(out)
    try:
        facts = pipeline.lower_to_dir(model_dir, out, memo=not no_memo)
    except InputError as exc:
        _fail(exc, model_dir)
    except OSError as exc:  # writing the facts directory
        _fail(_os_error(exc, out), out)
    typer.echo(f"wrote {facts.count()} facts to {out}")


def _undecodable(facts_dir: Path) -> Path:
    """The first .facts file that is not text (to name it in the error)."""
    for path in sorted(facts_dir.glob("*.facts")):
        try:
            path.read_text()
        except UnicodeDecodeError:
            return path
    return facts_dir


JunitOpt = Annotated[Optional[Path], typer.Option("--junit", help="also write JUnit XML here (one testcase per sequential output)")]
HtmlOpt = Annotated[Optional[Path], typer.Option("--html", help="also write a self-contained HTML page here (the failing node's neighbourhood)")]
ExplainOpt = Annotated[Optional[str], typer.Option("--explain", metavar="OUTPUT", help="print the derivation chain of this sequential output")]


@app.command()
def run(
    facts: Annotated[Path, typer.Option("--facts", help="facts directory written by `refine lower`")],
    rules: RulesOpt = None,
    json_path: JsonOpt = None,
    junit_path: JunitOpt = None,
    html_path: HtmlOpt = None,
    explain: ExplainOpt = None,
    no_simulate: Annotated[bool, typer.Option("--no-simulate", help="accepted for symmetry with verify: facts have no ONNX, so run never simulates (verdict verified or unproven only)")] = False,
    quiet: QuietOpt = False,
    progress_mode: ProgressOpt = ProgressMode.auto,
    verbose: VerboseOpt = False,
) -> None:
    """Run the lemma library over a facts directory and print the verdict (verified or unproven:
    without the ONNX models there is no counterexample search)."""
    _check_json_path(json_path)
    _check_out_path(junit_path, "--junit")
    _check_out_path(html_path, "--html")
    try:
        with progress_display(quiet, mode=progress_mode) as progress:
            report = pipeline.run_facts_dir(facts, rules, explain=explain, progress=progress)
    except InputError as exc:
        _fail(exc, facts)
    except UnicodeDecodeError:
        _fail(InputError(_undecodable(facts), "not a text file"), facts)
    except OSError as exc:
        _fail(_os_error(exc, facts), facts)
    _finish(report, json_path, junit_path, html_path, verbose)


@app.command()
def verify(
    model_dir: Annotated[Path, typer.Argument(help="directory with seq.onnx, rank*.onnx, refine.json")],
    rules: RulesOpt = None,
    json_path: JsonOpt = None,
    junit_path: JunitOpt = None,
    html_path: HtmlOpt = None,
    explain: ExplainOpt = None,
    no_simulate: Annotated[bool, typer.Option("--no-simulate", help="skip the counterexample search after a failed proof (the verdict is then verified or unproven)")] = False,
    no_memo: NoMemoOpt = False,
    sim_memory: Annotated[float, typer.Option("--sim-memory", min=0, help="GiB of values the counterexample search may hold; above it, an export refine made is searched again at reduced sizes, anything else is not simulated (verdict unproven)")] = 4.0,
    no_rule_check: Annotated[bool, typer.Option("--no-rule-check", help="with --rules: do not check the relations your lemmas derive on a simulation of the model")] = False,
    jobs: Annotated[int, typer.Option("--jobs", "-j", min=1, help="processes for layer template solves: with N > 1, the distinct layers of a stack are solved ahead in N - 1 worker processes under guessed keys, each result used only where the walk meets its exact key (refine/run/template_solves.py)")] = 1,
    quiet: QuietOpt = False,
    progress_mode: ProgressOpt = ProgressMode.auto,
    verbose: VerboseOpt = False,
) -> None:
    """Lower and run in one step. If the proof fails, simulate the programs on inputs that satisfy
    the declared relations: REFUTED only with a numeric counterexample, else UNPROVEN. With
    --rules, every relation derived on the model is also checked on a simulation: a proof that
    rests on a relation that does not hold is UNPROVEN."""
    _check_json_path(json_path)
    _check_out_path(junit_path, "--junit")
    _check_out_path(html_path, "--html")
    try:
        with progress_display(quiet, mode=progress_mode) as progress:
            report = pipeline.verify_dir(model_dir, rules, simulate=not no_simulate, explain=explain,
                                         memo=not no_memo, progress=progress, sim_memory_gib=sim_memory,
                                         rule_check=not no_rule_check, jobs=jobs)
    except InputError as exc:
        _fail(exc, model_dir)
    _finish(report, json_path, junit_path, html_path, verbose)


@app.command()
def export(
    out: Annotated[Path, typer.Option("--out", help="model directory to write (replaced if it is one)")],
    model: Annotated[Optional[str], typer.Option("--model", help="zoo model: llama, qwen2, gpt2, mixtral (not with --framework megatron-core); --framework torchtitan: llama3 (default) or qwen3_moe")] = None,
    module: Annotated[Optional[str], typer.Option("--module", help="your own module: path/to/file.py:factory, the factory returning a dict of model, batch and optionally loss_fn, parallelize, ranges; with --tp N (its parallelize), --dp N [--fsdp] (DDP, FSDP2), --train, --micro-batches M (exporters/README.md)")] = None,
    model_type: Annotated[Optional[str], typer.Option("--model-type", help="--framework transformers: an HF model type (llama, qwen3, gemma2, phi3, ...), distributed by HF's own TP plan; --config tiny or a config.json (docs/frameworks.md)")] = None,
    framework: Annotated[str, typer.Option("--framework", help="zoo (this repository's models), megatron-core (Megatron-Core's own GPTModel) or transformers (an HF model type under HF's own TP plan, --model-type)")] = "zoo",
    config: Annotated[str, typer.Option("--config", help="zoo: tiny, tiny-gqa, tiny-b1, llama3-8b, llama3-70b, llama3-405b; megatron-core: tiny, tiny-llama, tiny-moe (Megatron's MoELayer; with --ep N: EP over the TP ranks, alltoall dispatcher), tiny-moe-shared (and a shared expert), gpt-125m, llama3-405b")] = "tiny",
    tp: Annotated[Optional[int], typer.Option("--tp", help="tensor-parallel degree (the world size; default 2, 1 with --pp); with --dp: a TP x DP mesh, forward or with --train a training step (exporters/strategies/mesh.py)")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="pipeline stages (the world size): gpt2, llama, qwen2; GPipe order, forward (exporters/strategies/pipeline.py) or with --train one training step, the tied embedding's gradient all-reduced over the first and last stage (exporters/strategies/pipeline_train.py); with --tp T: a PP x TP mesh, the TP plan inside each stage (exporters/strategies/pipeline_mesh.py); with --tp T --dp D [--cp C] --train: a PP x DP x CP x TP training step (exporters/strategies/mesh4d.py)")] = None,
    micro_batches: Annotated[int, typer.Option("--micro-batches", help="with --pp: micro-batches the batch is cut into (with --train, gradients accumulated over them); with --dp --train: gradient accumulation steps")] = 1,
    batch: Annotated[Optional[int], typer.Option("--batch", help="with --dp (with or without --tp): batch rows instead of the config's")] = None,
    cp: Annotated[Optional[int], typer.Option("--cp", help="context-parallel ranks (the world size): gpt2 or llama (RoPE: each rank's rotary positions and causal mask offset by its slice), K/V all-gathered along the sequence (exporters/strategies/context.py, context_llama.py; --zigzag gpt2 only)")] = None,
    ring: Annotated[bool, typer.Option("--ring", help="with --cp: ring attention, K/V blocks passed round the ranks by Send/Recv and merged by the online-softmax rule (rules/ring.lp)")] = False,
    zigzag: Annotated[bool, typer.Option("--zigzag", help="with --cp N: zig-zag (load-balanced) chunks, rank r computes sequence chunks r and 2N-1-r of 2N, K/V all-gathered back into order, logits a stride-2 shard (not with --ring)")] = False,
    loss: Annotated[bool, typer.Option("--loss", help="with --cp N: the forward training loss instead of the logits (token cross-entropy against labels shifted before the split and sliced alongside the token ids, each rank's sum over the all-reduced token count; no gradients: --train exports the step; not with --ring or --zigzag)")] = False,
    ep: Annotated[Optional[int], typer.Option("--ep", help="expert-parallel ranks (the world size): mixtral, experts sharded, tokens dispatched and combined by all-to-all, batch rows split over the ranks (exporters/strategies/expert.py); with --tp T: an EP x TP mesh, attention TP within each row, experts over each column (exporters/strategies/expert_mesh.py); --framework torchtitan --model qwen3_moe: --ep T with --tp T, torchtitan's expert_parallel_degree (its all-to-all token dispatcher, at static capacity); --framework transformers: --ep T with --tp T, HF's expert-parallel plan over the TP ranks (AllReduceEP: every rank runs its own experts on the whole batch, the outputs all-reduced)")] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", help="data-parallel ranks (the world size): gpt2, llama, qwen2; each rank a replica on its batch slice; with --train, loss normalised by the global token count and gradients all-reduced (exporters/strategies/data_parallel.py); with --tp T: D x T mesh ranks, TP within each row, with --train the DP step over each column (exporters/strategies/mesh.py)")] = None,
    sp: Annotated[bool, typer.Option("--sp", help="also shard the sequence between blocks")] = False,
    check: Annotated[bool, typer.Option("--check", help="run torch and the programs; exit 1 on a mismatch")] = False,
    seed: Annotated[int, typer.Option("--seed", help="weights and example input seed")] = 0,
    layers: Annotated[int | None, typer.Option("--layers", help="override the config's number of layers")] = None,
    meta: Annotated[bool, typer.Option("--meta", help="build on the meta device: weights declared, no data")] = False,
    flat: Annotated[bool, typer.Option("--flat", help="every layer inline, not one local function per distinct layer")] = False,
    train: Annotated[bool, typer.Option("--train", help="one training step: outputs loss and grad.<parameter> per parameter (with --cp: the K/V all-gathers' backward reduce-scatters, gradients all-reduced over the CP ranks)")] = False,
    schedule: Annotated[str, typer.Option("--schedule", help="with --pp --train: the micro-batches' order, gpipe (every forward, then every backward) or 1f1b (a few forwards ahead, then one forward and one backward in turn; exporters/strategies/pipeline_train.py)")] = "gpipe",
    fsdp: Annotated[bool, typer.Option("--fsdp", help="with --dp --train: FSDP / ZeRO-3, every parameter sharded along axis 0, all-gathered for use, gradients reduce-scattered (exporters/strategies/data_parallel.py)")] = False,
    bug: Annotated[Optional[str], typer.Option("--bug", help="megatron-core: inject a bug of exporters/frameworks/megatron_bugs.py into the ranks; transformers --ep: one of exporters/frameworks/transformers_bugs.py into HF's AllReduceEP or AllToAllEP; --pp, --cp, --ep, --dp: of exporters/strategies/pipeline.py, context.py, expert.py, data_parallel.py; --tp with --dp: of exporters/strategies/mesh.py (zoo TP models: refine zoo --bugs)")] = None,
    backend: Annotated[Optional[str], typer.Option("--backend", help="--framework torchtitan: its SPMD backend, spmd_types (default), partial_dtensor or full_dtensor")] = None,
    experts: Annotated[Optional[str], typer.Option("--experts", help="--framework transformers: HF's experts implementation, grouped_mm or batched_mm (default: the model's); with --ep, batched_mm verifies (docs/moe.md)")] = None,
    ep_implementation: Annotated[Optional[str], typer.Option("--ep-implementation", help="--framework transformers with --ep: HF's expert-parallel dispatch, all_reduce (default: AllReduceEP, no token moves) or all_to_all (AllToAllEP: routes exchanged by ragged all-to-alls, at static capacity; verified with both experts implementations, the training step with --experts batched_mm, docs/moe.md)")] = None,
) -> None:
    """Export a zoo model, or Megatron-Core's GPTModel, and its parallel plan to a model directory (needs the torch extra; megatron-core also the megatron extra)."""
    from refine.exporters.zoo.configs import FRAMEWORKS, validate, validate_megatron, validate_megatron_moe  # no torch: bad arguments fail fast
    from refine.exporters.errors import ExportError

    if check and meta:
        _usage_error("--check needs weights, and --meta exports none: drop one of them")
    if framework not in FRAMEWORKS:
        _usage_error(f"unknown framework {framework!r} (known: {', '.join(FRAMEWORKS)})")
    if framework == "torchtitan":  # torchtitan's own parallelize path (exporters/frameworks/torchtitan.py)
        other = [flag for flag, given in (("--model-type", model_type), ("--module", module),
                                          ("--meta", meta), ("--layers", layers), ("--batch", batch), ("--ring", ring),
                                          ("--zigzag", zigzag), ("--loss", loss), ("--flat", flat),
                                          ("--schedule", schedule != "gpipe")) if given]
        if other:
            _usage_error(f"--framework torchtitan exports its models through its own parallelize path: drop {', '.join(other)}")
        _export_torchtitan(model or "llama3", config, out, tp=tp or 1, sp=sp, dp=dp, fsdp=fsdp, cp=cp or 1, pp=pp or 1,
                           micro_batches=micro_batches, backend=backend or "spmd_types", train=train, bug=bug, seed=seed,
                           check=check, ep=ep or 1)
        return
    if backend is not None:
        _usage_error("--backend is torchtitan's SPMD backend: pass --framework torchtitan")
    if experts is not None and framework != "transformers":
        _usage_error("--experts is HF's experts implementation: pass --framework transformers")
    if ep_implementation is not None and framework != "transformers":
        _usage_error("--ep-implementation is HF's expert-parallel dispatch: pass --framework transformers")
    if framework == "transformers":  # HF's own plan (exporters/frameworks/transformers.py)
        other = [flag for flag, given in (("--model", model), ("--pp", pp), ("--cp", cp), ("--dp", dp),
                                          ("--meta", meta), ("--layers", layers)) if given]
        if other:
            _usage_error(f"--framework transformers exports an HF model type under HF's TP plan: drop {', '.join(other)}")
        _export_transformers(model_type, config, (ep or 2) if tp is None else tp, sp, train, out, seed, flat, check, ep,
                             experts, bug, ep_implementation)
        return
    if module is not None:  # the user's own module (exporters/strategies/own_file.py)
        other = [flag for flag, given in (("--model", model), ("--model-type", model_type), ("--pp", pp), ("--cp", cp),
                                          ("--ep", ep), ("--sp", sp), ("--meta", meta), ("--bug", bug),
                                          ("--layers", layers), ("--batch", batch)) if given]
        if other or framework != "zoo":
            _usage_error(f"--module exports your own module: drop {', '.join(other) or '--framework'}")
        _export_own_module(module, out, tp, dp, fsdp, micro_batches, train, check)
        return
    if model_type is not None:
        _usage_error("--model-type is for --framework transformers (zoo models: --model)")
    megatron = framework == "megatron-core"
    if megatron and model is not None:
        _usage_error("--framework megatron-core exports Megatron's GPTModel: drop --model")
    if not megatron and model is None:
        _usage_error("Missing option '--model' (or pass --framework megatron-core)")
    if megatron and ep is not None:  # Megatron's MoE, experts over --ep of the TP ranks (exporters/frameworks/megatron.py)
        other = [flag for flag, given in (("--pp", pp), ("--cp", cp), ("--dp", dp), ("--ring", ring), ("--zigzag", zigzag),
                                          ("--loss", loss), ("--fsdp", fsdp), ("--batch", batch), ("--bug", bug),
                                          ("--micro-batches", micro_batches != 1), ("--schedule", schedule != "gpipe"))
                 if given]
        if other:
            _usage_error(f"--framework megatron-core --ep exports Megatron's MoE under TP and EP: drop {', '.join(other)}")
        try:
            validate_megatron_moe(config, tp or ep, sp, ep, None, train=train, layers=layers, meta=meta)
            from refine.exporters.frameworks.megatron import export_megatron

            result = export_megatron(config, tp or ep, sp, out, seed, layers=layers, meta=meta, flat=flat, train=train,
                                     ep=ep)
            _summary_and_check(result.summary(), (), out, seed, check)
        except ExportError as exc:
            _usage_error(str(exc))
        except ImportError as exc:
            _usage_error(f"export needs the torch extra (pip install 'refine[torch]'): {exc}")
        return
    plans = [name for name, degree in (("--pp", pp), ("--cp", cp), ("--ep", ep), ("--dp", dp)) if degree is not None]
    # PP x DP x CP x TP: a pipeline mesh's training step with data and context parallelism (exporters/strategies/mesh4d.py)
    four_d = pp is not None and tp not in (None, 1) and (dp is not None or cp is not None) and ep is None
    if four_d:
        if not train:
            _usage_error("--pp --tp with --dp or --cp exports the training step (exporters/strategies/mesh4d.py): pass --train")
        for flag, given in (("--ring", ring), ("--zigzag", zigzag), ("--loss", loss), ("--fsdp", fsdp)):
            if given:
                _usage_error(f"{flag} with --pp --tp --dp/--cp is not built yet: the mesh's CP all-gathers K/V, its DP "
                             "all-reduces the gradients")
        plans = ["--pp"]
    if len(plans) > 1:
        _usage_error(f"{' and '.join(plans)} together are not supported yet: export one plan")
    if plans:
        _one_plan_usage(megatron, tp, sp, train, plans[0])
    mesh = dp is not None and tp not in (None, 1) and not four_d  # a TP x DP mesh (exporters/strategies/mesh.py)
    stages_tp = pp is not None and tp not in (None, 1)  # a PP x TP mesh (exporters/strategies/pipeline_mesh.py)
    experts_tp = ep is not None and tp not in (None, 1)  # an EP x TP mesh (exporters/strategies/expert_mesh.py)
    if mesh and micro_batches != 1:
        _usage_error("--micro-batches is for a pipeline or a data-parallel training step, not a TP x DP mesh")
    if micro_batches != 1 and pp is None and dp is None:
        _usage_error("--micro-batches is for a pipeline or data-parallel export: pass --pp N or --dp N too")
    if ring and cp is None:
        _usage_error("--ring is context parallelism's ring attention: pass --cp N too")
    if zigzag and cp is None:
        _usage_error("--zigzag is context parallelism's load-balanced sequence chunks: pass --cp N too")
    if loss and cp is None:
        _usage_error("--loss is context parallelism's forward training loss: pass --cp N too")
    if batch is not None and dp is None and not stages_tp:
        _usage_error("--batch is for a data-parallel export or a PP x TP mesh: pass --dp N (or --pp P --tp T) too")
    if fsdp and (dp is None or mesh):
        _usage_error("--fsdp shards a data-parallel training step's parameters: pass --dp N --train (without --tp)")
    if schedule != "gpipe" and (pp is None or not train):
        _usage_error("--schedule orders a pipeline training step's micro-batches: pass --pp N --train")
    if schedule not in ("gpipe", "1f1b"):
        _usage_error(f"--schedule {schedule}: one of gpipe, 1f1b")
    if bug is not None and not megatron and not plans:
        _usage_error("--bug is for --framework megatron-core, --pp, --cp, --ep or --dp; zoo twins are made by `refine zoo --bugs NAME`")
    tp = tp if mesh or stages_tp or experts_tp else 1 if plans else 2 if tp is None else tp
    try:
        if stages_tp:
            from refine.exporters.strategies.pipeline_mesh import validate_pipeline_mesh  # torch

            assert model is not None and pp is not None and tp is not None
            if train:  # one training step of the stages' TP plans (exporters/strategies/pipeline_mesh_train.py)
                from refine.exporters.strategies.pipeline_mesh_train import validate_pipeline_mesh_train

                validate_pipeline_mesh_train(model, config, pp, tp, micro_batches, layers=layers, meta=meta, bug=bug,
                                             batch=batch, order=schedule, dp=dp or 1, cp=cp or 1)
            else:
                validate_pipeline_mesh(model, config, pp, tp, micro_batches, layers=layers, meta=meta, bug=bug,
                                       batch=batch)
        elif mesh:
            from refine.exporters.strategies.mesh import validate_mesh  # torch

            assert model is not None and dp is not None and tp is not None
            validate_mesh(model, config, tp, dp, sp=sp, layers=layers, meta=meta, batch=batch, bug=bug, train=train)
        elif dp is not None:
            from refine.exporters.strategies.data_parallel import validate_data_parallel  # torch

            assert model is not None
            validate_data_parallel(model, config, dp, layers=layers, train=train, bug=bug, micro_batches=micro_batches,
                                   batch=batch, fsdp=fsdp)
        elif pp is not None:
            from refine.exporters.strategies.pipeline import validate_pipeline  # torch

            assert model is not None
            validate_pipeline(model, config, pp, micro_batches, layers=layers, meta=meta, bug=bug, train=train)
        elif experts_tp:
            from refine.exporters.strategies.expert_mesh import validate_expert_mesh  # torch

            assert model is not None
            validate_expert_mesh(model, config, ep, tp, layers=layers, meta=meta, bug=bug)
        elif ep is not None:
            from refine.exporters.strategies.expert import expert_bug, validate_expert  # torch

            assert model is not None
            validate_expert(model, config, ep, layers=layers, meta=meta)
            expert_bug(bug)
        elif cp is not None:
            from refine.exporters.strategies.context import context_bug, validate_context  # torch

            assert model is not None
            validate_context(model, config, cp, layers=layers, ring=ring, zigzag=zigzag, loss=loss, train=train)
            context_bug(bug, ring=ring, zigzag=zigzag, loss=loss or train)
        elif megatron:
            checked = validate_megatron(config, tp, sp, layers=layers, meta=meta)
            if bug is not None:
                from refine.exporters.frameworks.megatron_bugs import megatron_bug
                from refine.exporters.zoo.configs import MegatronMoEConfig

                megatron_bug(bug, checked.style, sp, train, isinstance(checked, MegatronMoEConfig))
        else:
            assert model is not None
            validate(model, config, tp, sp, layers=layers, meta=meta)
        import importlib

        import refine.exporters

        for needs_torch in ("refine.exporters.capture.export", "refine.exporters.capture.numeric"):  # fail here, in one line, without torch
            importlib.import_module(needs_torch)
    except ExportError as exc:
        _usage_error(str(exc))
    except ImportError as exc:
        _usage_error(f"export needs the torch extra (pip install 'refine[torch]'): {exc}")
    try:
        if stages_tp:
            assert model is not None and pp is not None and tp is not None
            if train:
                from refine.exporters.strategies.pipeline_mesh_train import export_pipeline_mesh_train

                result = export_pipeline_mesh_train(model, config, pp, tp, micro_batches, out, seed, layers=layers,
                                                    meta=meta, batch=batch, bug=bug, order=schedule, dp=dp or 1,
                                                    cp=cp or 1, functions=not flat)
            else:
                from refine.exporters.strategies.pipeline_mesh import export_pipeline_mesh

                result = export_pipeline_mesh(model, config, pp, tp, micro_batches, out, seed, layers=layers,
                                              meta=meta, batch=batch, bug=bug, functions=not flat)
        elif mesh:
            from refine.exporters.strategies.mesh import export_mesh

            assert model is not None and dp is not None and tp is not None
            result = export_mesh(model, config, tp, dp, out, seed, sp=sp, batch=batch, bug=bug, meta=meta,
                                 layers=layers, flat=flat, train=train)
        elif dp is not None:
            from refine.exporters.strategies.data_parallel import export_data_parallel

            assert model is not None
            result = export_data_parallel(model, config, dp, out, seed, bug=bug, meta=meta, layers=layers, flat=flat,
                                          train=train, micro_batches=micro_batches, batch=batch, fsdp=fsdp)
        elif pp is not None:
            assert model is not None
            if train:  # one training step, GPipe or 1F1B order (exporters/strategies/pipeline_train.py)
                from refine.exporters.strategies.pipeline_train import export_pipeline_train

                result = export_pipeline_train(model, config, pp, micro_batches, out, seed, layers=layers, bug=bug,
                                               order=schedule)
            else:
                from refine.exporters.strategies.pipeline import export_pipeline

                result = export_pipeline(model, config, pp, micro_batches, out, seed, layers=layers, meta=meta, bug=bug)
        elif experts_tp:
            from refine.exporters.strategies.expert_mesh import export_expert_mesh

            assert model is not None
            result = export_expert_mesh(model, config, ep, tp, out, seed, bug=bug, layers=layers, flat=flat, meta=meta)
        elif ep is not None:
            from refine.exporters.strategies.expert import export_expert_parallel

            assert model is not None
            result = export_expert_parallel(model, config, ep, out, seed, bug=bug, layers=layers, flat=flat, meta=meta)
        elif cp is not None:
            from refine.exporters.strategies.context_export import export_context_parallel

            assert model is not None
            result = export_context_parallel(model, config, cp, out, seed, bug=bug, meta=meta, layers=layers, flat=flat,
                                             ring=ring, zigzag=zigzag, loss=loss, train=train)
        elif megatron:
            from refine.exporters.frameworks.megatron import export_megatron

            result = export_megatron(config, tp, sp, out, seed, layers=layers, meta=meta, flat=flat, train=train, bug=bug)
        else:
            assert model is not None
            result = refine.exporters.export_model(model, config, tp, sp, out, seed, layers=layers, meta=meta, flat=flat,
                                            train=train)
        _summary_and_check(result.summary(), (), out, seed, check)
    except ExportError as exc:
        _usage_error(str(exc))


def _summary_and_check(summary: str, warnings: Iterable[str], out: Path, seed: int, check: bool) -> None:
    """An export's summary line and warnings; with --check, torch's run of the programs against
    the sequential model (exit 1 on a mismatch)."""
    typer.echo(summary)
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    if check:
        import refine.exporters

        outcome = refine.exporters.check(out, seed=seed)
        typer.echo(outcome.render())
        raise typer.Exit(0 if outcome.ok else 1)


def _export_torchtitan(model: str, config: str, out: Path, *, tp: int, sp: bool, dp: int | None, fsdp: bool, cp: int, pp: int,
                      micro_batches: int, backend: str, train: bool, bug: str | None, seed: int, check: bool,
                      ep: int = 1) -> None:
    """`refine export --framework torchtitan`: bad arguments in one line (exit 2) before torch is
    imported, then the export, its warnings, and with --check the numeric check (exit 1 on a mismatch)."""
    from refine.exporters.errors import ExportError

    try:
        if fsdp and dp is None:
            raise ExportError("--framework torchtitan --fsdp: pass the FSDP degree as --dp N (torchtitan's dp_shard)")
        if dp is not None and not fsdp:
            raise ExportError("--framework torchtitan --dp N: replicated data parallelism (torchtitan's dp_replicate) is "
                              "not supported yet; --dp N --fsdp shards it (FSDP2, torchtitan's dp_shard)")
        shards = dp or 1
        from refine.exporters.frameworks.torchtitan_bugs import torchtitan_bug
        from refine.exporters.zoo.configs import validate_torchtitan

        validate_torchtitan(config, tp=tp, sp=sp, fsdp=shards, cp=cp, pp=pp, micro_batches=micro_batches, backend=backend,
                            model=model)
        if bug is not None:
            torchtitan_bug(bug, sp=sp, train=train, backend=backend, cp=cp, pp=pp, tp=tp, model=model, fsdp=shards, ep=ep)
        from refine.exporters.frameworks.torchtitan import export_torchtitan

        result = export_torchtitan(config, out, tp=tp, sp=sp, fsdp=shards, cp=cp, pp=pp, micro_batches=micro_batches,
                                   backend=backend, train=train, bug=bug, seed=seed, model=model, ep=ep)
    except ExportError as exc:
        _usage_error(str(exc))
    except ImportError as exc:
        _usage_error(f"--framework torchtitan needs the torch and torchtitan extras (pip install -e '.[torch,torchtitan]'): {exc}")
    _summary_and_check(result.summary(), result.warnings(), out, seed, check)


def _export_transformers(model_type: str | None, config: str, tp: int, sp: bool, train: bool, out: Path, seed: int,
                         flat: bool, check: bool, ep: int | None, experts: str | None, bug: str | None,
                         ep_implementation: str | None = None) -> None:
    """`refine export --framework transformers`: bad arguments in one line (exit 2) before torch is
    imported, then the export (and --check: exit 1 on a mismatch)."""
    from refine.exporters.errors import ExportError
    from refine.exporters.frameworks.transformers_bugs import transformers_bug
    from refine.exporters.frameworks.transformers_configs import validate as validate_transformers

    try:
        hf_config = validate_transformers(model_type, config, tp, sp, train, ep, experts, ep_implementation)
        if bug is not None:
            transformers_bug(bug, ep=ep, train=train, model_type=hf_config.model_type,
                             ep_implementation=ep_implementation or "all_reduce")
        from refine.exporters.frameworks.transformers import export_model_type

        result = export_model_type(model_type, tp, out, config=config, seed=seed, train=train, flat=flat, ep=ep,
                                   experts=experts, bug=bug, ep_implementation=ep_implementation)
        _summary_and_check(result.summary(), (), out, seed, check)
    except ExportError as exc:
        _usage_error(str(exc))
    except ImportError as exc:
        _usage_error(f"--framework transformers needs the torch extra (pip install 'refine[torch]'): {exc}")


def _export_own_module(spec: str, out: Path, tp: int | None, dp: int | None, fsdp: bool, micro_batches: int,
                       train: bool, check: bool) -> None:
    """`refine export --module file.py:factory`: the export (bad input: one line, exit 2), and with
    --check the numeric check (exit 1 on a mismatch)."""
    from refine.exporters.errors import ExportError

    try:
        from refine.exporters.strategies.own_file import export_from_file

        result, outcome = export_from_file(spec, out, tp=tp, dp=dp, fsdp=fsdp, micro_batches=micro_batches, train=train,
                                           check=check)
    except ExportError as exc:
        _usage_error(str(exc))
    except ImportError as exc:
        _usage_error(f"--module needs the torch extra (pip install 'refine[torch]'): {exc}")
    typer.echo(result.summary())
    if outcome is not None:
        typer.echo(outcome.render())
        raise typer.Exit(0 if outcome.ok else 1)


def _one_plan_usage(megatron: bool, tp: int | None, sp: bool, train: bool, plan: str) -> None:
    """The options a pipeline (--pp), context-parallel (--cp), expert-parallel (--ep) or
    data-parallel (--dp) export cannot take yet: one line and exit 2 for the first. --dp with --tp
    (2 or more) is a TP x DP mesh, its forward or training step (exporters/strategies/mesh.py, which validates
    it); --pp with --tp a PP x TP mesh; --ep with --tp an EP x TP mesh (exporters/strategies/expert_mesh.py)."""
    if megatron:
        _usage_error(f"{plan} exports a zoo model, not --framework megatron-core")
    if plan in ("--dp", "--pp", "--ep") and tp not in (None, 1):
        if plan == "--ep" and (sp or train):
            _usage_error("--ep with --tp exports the forward of an EP x TP mesh (exporters/strategies/expert_mesh.py): "
                         "no --sp or --train yet")
        if plan == "--pp" and sp:
            _usage_error("--pp with --tp exports a TP plan inside each stage, its forward or with --train its training "
                         "step (exporters/strategies/pipeline_mesh.py, pipeline_mesh_train.py): no --sp yet")
        return
    if tp not in (None, 1):
        _usage_error(f"{plan} with --tp {tp} (with tensor parallelism together) is not supported yet: export one plan")
    if sp:
        _usage_error(f"--sp shards the sequence of a tensor-parallel plan: not with {plan}")
    if train and plan not in ("--dp", "--pp", "--cp"):
        _usage_error(f"{plan} exports the forward only: drop --train")


@app.command()
def batch(
    root: Annotated[Path, typer.Argument(help="directory of model directories (every directory holding refine.json, recursively)")],
    jobs: Annotated[Optional[int], typer.Option("--jobs", "-j", min=1, help="worker processes (default: the cores)")] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=0, help="seconds per entry before its worker is killed (0: no limit)")] = 600,
    memory: Annotated[Optional[int], typer.Option("--memory", min=1, help="address-space cap per worker, in MiB")] = None,
    plan: Annotated[Optional[str], typer.Option("--plan", help="tp:N: also shard every plain .onnx model Megatron-style over N ranks and verify it")] = None,
    no_cache: Annotated[bool, typer.Option("--no-cache", help="verify every entry again, without reading or writing the cache")] = False,
    cache_dir: Annotated[Optional[Path], typer.Option("--cache-dir", help="where verdicts are cached (default: ROOT/.refine-cache)")] = None,
    json_path: Annotated[Optional[Path], typer.Option("--json", help="also write every entry's report as JSON here")] = None,
    junit_path: Annotated[Optional[Path], typer.Option("--junit", help="also write JUnit XML here (one testcase per entry)")] = None,
    rules: RulesOpt = None,
    no_simulate: Annotated[bool, typer.Option("--no-simulate", help="skip the counterexample search after a failed proof")] = False,
    no_memo: NoMemoOpt = False,
    quiet: QuietOpt = False,
    coverage: Annotated[bool, typer.Option("--coverage", help="after the table, also list the op types of all entries that no rule file handles "
                                           "(the batch still runs; for the coverage alone: refine rules coverage DIR...)")] = False,
    ray: Annotated[Optional[str], typer.Option("--ray", metavar="ADDRESS", help="run the entries as tasks on the Ray cluster at ADDRESS "
                                               "(host:port; `auto`: the one `ray start --head` runs on this machine); needs the ray extra")] = None,
) -> None:
    """Verify every model directory under ROOT in parallel worker processes, or as tasks on a
    Ray cluster (docs/batch.md); exit 0 only if every entry got the verdict its refine.json
    expects (verified by default)."""
    from refine.batch import entries, local, output

    _check_json_path(json_path)
    _check_out_path(junit_path, "--junit")
    try:
        if ray is not None and not jobs:  # as many tasks in flight as the cluster has CPUs
            from refine.batch import ray_cluster as ray_batch

            jobs = ray_batch.cluster_cpus(ray)
        options = entries.BatchOptions(
            timeout=timeout or None, memory_mb=memory, rules=tuple(rules or ()), simulate=not no_simulate,
            memo=not no_memo, plan_tp=entries.parse_plan(plan), use_cache=not no_cache, cache_dir=cache_dir,
            ray=ray, **({"jobs": jobs} if jobs else {}))
        with local.progress_bar(quiet) as callbacks:
            result = local.run_batch(root, options, callbacks)
        output.write_outputs(result, json_path, junit_path)
    except InputError as exc:
        _fail(exc, root)
    except KeyboardInterrupt:
        typer.echo("refine: interrupted", err=True)
        raise typer.Exit(130) from None
    output.print_summary(result)
    if coverage:
        print_batch_coverage(root, options.plan_tp, rules)
    raise typer.Exit(result.exit_code)


@app.command()
def zoo(
    out: Annotated[Optional[Path], typer.Option("--out", help="directory to write the entries into (one subdirectory each; not needed with --list)")] = None,
    models: Annotated[Optional[str], typer.Option("--models", help="comma-separated: llama, gpt2, qwen2, mixtral (mixtral: the ep and eptp plans only; default: llama, gpt2, qwen2)")] = None,
    tp: Annotated[Optional[str], typer.Option("--tp", help="comma-separated TP degrees: 2, 4, 8 (default: all)")] = None,
    plans: Annotated[Optional[str], typer.Option("--plans", help="comma-separated: tp, sp (default: both); dp, dpsp: TP, TP+SP within each row of a DP x TP mesh (exporters/strategies/mesh.py; dp also its training step); fsdp: the FSDP training step (exporters/strategies/data_parallel.py, --steps train); forward at fixed degrees, no --tp: pp (PP 2, 2 micro-batches), pptp (PP 2 x TP 2, 2 micro-batches), cp, ring, zigzag (gpt2, CP 2: K/V all-gathered, ring attention, zig-zag chunks), ep (mixtral, EP 2), eptp (mixtral, EP 2 x TP 2); pptrain: gpt2's pipeline training step (PP 2, 2 micro-batches)")] = None,
    dp: Annotated[Optional[str], typer.Option("--dp", help="with --plans dp, dpsp or fsdp: comma-separated DP degrees: 2, 4, 8 (default: 2)")] = None,
    mesh: Annotated[Optional[str], typer.Option("--mesh", metavar="dp=D,tp=T", help="a DP x TP mesh: --plans dp --dp D --tp T (with --plans: dp and/or dpsp on that mesh)")] = None,
    bugs: Annotated[Optional[str], typer.Option("--bugs", help="comma-separated bugs of exporters/zoo/bugs.py (mesh plans: of exporters/strategies/mesh.py; fsdp: of exporters/strategies/data_parallel.py), `none` for the correct export (default: all of the plan's and step's)")] = None,
    steps: Annotated[Optional[str], typer.Option("--steps", help="comma-separated: infer (the forward), train (one training step: loss and every gradient) (default: infer)")] = None,
    config: Annotated[str, typer.Option("--config", help="zoo size")] = "tiny",
    seed: Annotated[int, typer.Option("--seed", help="weights and example input seed")] = 0,
    force: Annotated[bool, typer.Option("--force", help="export entries again even if present and current")] = False,
    list_only: Annotated[bool, typer.Option("--list", help="print the selected entries and their expected verdicts; export nothing")] = False,
    framework: Annotated[str, typer.Option("--framework", help="zoo (this repository's models), transformers (HF model types under HF's own TP plan: --model-types, --tp, --steps), torchtitan (its Llama 3 and Qwen3-MoE plans and twins: --steps) or megatron-core (Megatron's GPTModel, GPT and Llama style and its MoELayer, and their twins: --steps)")] = "zoo",
    model_types: Annotated[Optional[str], typer.Option("--model-types", help="--framework transformers: all (default) or comma-separated HF model types")] = None,
    expert_parallel: Annotated[bool, typer.Option("--ep", help="--framework transformers: the model types that ship an expert-parallel plan, under it over the TP ranks (HF's AllReduceEP)")] = False,
    experts: Annotated[Optional[str], typer.Option("--experts", help="with --ep: comma-separated HF experts implementations, batched_mm (default) and grouped_mm (HF's default: entries hf_T_tpN_ep_grouped)")] = None,
    ep_implementations: Annotated[Optional[str], typer.Option("--ep-implementation", help="with --ep: comma-separated HF expert-parallel dispatches, all_reduce (default) and all_to_all (AllToAllEP, batched_mm experts: entries hf_T_tpN_ep_a2a)")] = None,
) -> None:
    """Generate a zoo with the exporters: models x TP degrees x plans (x DP degrees on a mesh or
    under FSDP), and buggy twins of each with the verdict refine must give them in refine.json (needs the torch extra)."""
    from refine.exporters.errors import ExportError
    from refine.exporters.zoo.entries import generate, left_out, mesh_selection, select  # no torch: a bad selection fails fast

    if framework not in ("zoo", "transformers", "torchtitan", "megatron-core"):
        _usage_error(f"refine zoo --framework: zoo, transformers, torchtitan or megatron-core, not {framework!r}")
    given = [flag for flag, value in (("--model-types", model_types is not None), ("--ep", expert_parallel),
                                      ("--experts", experts is not None),
                                      ("--ep-implementation", ep_implementations is not None)) if value]
    if given and framework != "transformers":
        _usage_error(f"{given[0]} is for --framework transformers")
    try:
        if framework == "torchtitan":  # exporters/frameworks/torchtitan_zoo.py
            if any(v is not None for v in (models, tp, plans, dp, mesh, bugs)):
                _usage_error("--framework torchtitan takes --steps (its plans TP 2 and TP 2 + SP, both backends, every twin)")
            from refine.exporters.frameworks.torchtitan_zoo import select as select_torchtitan

            entries = select_torchtitan(steps, seed)  # type: ignore[assignment]
            notes = []
        elif framework == "megatron-core":  # exporters/frameworks/megatron_zoo.py
            if any(v is not None for v in (models, tp, plans, dp, mesh, bugs)):
                _usage_error("--framework megatron-core takes --steps (its plans at TP 2, every twin on its plan)")
            from refine.exporters.frameworks.megatron_zoo import select as select_megatron

            entries = select_megatron(steps, seed)  # type: ignore[assignment]
            notes = []
        elif framework == "transformers":
            if any(v is not None for v in (models, plans, dp, mesh, bugs)):
                _usage_error("--framework transformers takes --model-types, --tp, --steps, --ep, --experts and --ep-implementation (HF's own plans, no bug twins)")
            from refine.exporters.frameworks.transformers_zoo import select as select_transformers

            entries, skipped = select_transformers(model_types, tp, steps, seed, expert_parallel, experts,  # type: ignore[assignment]
                                                   ep_implementations)
            notes = [f"{name} left out: {why}" for name, why in skipped.items()]
        else:
            if mesh is not None:
                plans, dp, tp = mesh_selection(mesh, plans, dp, tp)
            entries = select(models, tp, plans, bugs, config, seed, steps, dp)
            notes = left_out(plans, steps)
    except ExportError as exc:
        _usage_error(str(exc))
    for note in notes:  # chosen plan and step pairs the zoo has no entries of
        typer.echo(f"refine: note: {note}", err=True)
    if list_only:
        for entry in entries:
            typer.echo(f"{entry.name}\t{entry.describe()}")
        raise typer.Exit(0)
    if out is None:
        _usage_error("zoo needs --out DIR to write the entries into (or --list to only print them)")
    if out.exists() and not out.is_dir():
        _usage_error(f"{out}: exists and is not a directory")
    try:
        import refine.exporters.zoo.bugs  # noqa: F401 - torch, transformers, onnxscript
    except ImportError as exc:
        _usage_error(f"zoo needs the torch extra (pip install 'refine[torch]'): {exc}")
    result = generate(entries, out, force=force,
                      on_entry=lambda entry, what: typer.echo(f"{what:>7} {out / entry.name} (expect {entry.describe()})"))
    for name, problem in result.failed.items():
        typer.echo(f"refine: error: {out / name}: {problem}", err=True)
    typer.echo(f"{len(entries)} entries: {len(result.written)} written, {len(result.kept)} already current, "
               f"{len(result.failed)} failed")
    raise typer.Exit(1 if result.failed else 0)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
