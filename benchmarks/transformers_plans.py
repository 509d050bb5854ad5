"""HF transformers' own TP plans, model type by model type (issue 40): exported?, verdict, time.

For every model type whose config class ships a TP plan (`base_model_tp_plan`), at each TP
degree and step: `refine export --framework transformers --model-type T --tp N [--train] --check`
(a tiny config, HF's plan as shipped, torch's run of the TP model compared with the sequential
one), then `refine verify`. Each step runs in a fresh process. A type that is not exported gets
its reason: the export's one-line error (no causal-LM class, an expert-parallel plan: issue
42, heads the plan cannot split, a model torch cannot capture, ...). Mixture-of-experts types
(an expert style in the plan) are counted apart in the totals. A REFUTED verdict is listed
with whether `--check` confirms it (torch's own TP run disagrees: a bug in transformers) or not
(a refine defect).

    python benchmarks/transformers_plans.py                              # every type, TP 2, forward
    python benchmarks/transformers_plans.py --tp 2 4 --steps infer train --types llama,qwen3,gemma2
    python benchmarks/transformers_plans.py --write                       # the table into RESULTS.md
    python benchmarks/transformers_plans.py --json rows.json --resume rows.json   # skip rows already run
    python benchmarks/transformers_plans.py --resume rows.json --table-only --write   # the table of those rows
    python benchmarks/transformers_plans.py --types mixtral,qwen3_moe --resume benchmarks/RESULTS.md --again --write
    python benchmarks/transformers_plans.py --steps ep ep_train --resume benchmarks/RESULTS.md --write

Steps `ep` and `ep_train` (issue 42) run the types that also ship an expert-parallel plan under it,
over the TP ranks: `--ep N --experts batched_mm` (HF's AllReduceEP), forward and training step;
`ep_grouped` and `ep_grouped_train` the same with HF's default experts, `--experts grouped_mm`;
`ep_a2a` and `ep_a2a_train` with HF's default experts under HF's token-moving AllToAllEP
(`--ep-implementation all_to_all`, exported at static capacity; UNPROVEN until lemmas read the
received rows the grouped_mm experts sort again, so these rows measure the export's reach and
`--check`), `ep_a2a_batched` and `ep_a2a_batched_train` the same with batched_mm experts (rules/
exchanged_rows.lp: the exchanges proven).

With `--resume`, every row of the file is kept in the table (chosen or not), so runs of several
selections (every type forward, then their training steps, then TP 4 for a few) add up to one table.

`--write` replaces the `## benchmarks/transformers_plans.py` section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
SECTION = "## benchmarks/transformers_plans.py (HF's own TP plans, issue 40)"
REFINE = [sys.executable, "-m", "refine.cli.main"]


@dataclass
class Row:
    model_type: str
    tp: int
    step: str
    exported: bool = False
    checked: bool | None = None  # --check passed (None: not exported)
    verdict: str = ""  # verified / refuted / unproven / error
    export_s: float = 0.0
    verify_s: float = 0.0
    reason: str = ""  # why not exported, or what the verdict says when not verified
    moe: bool = False  # a mixture-of-experts type (an expert style in its plan)

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.model_type, self.tp, self.step)


# the steps under HF's expert-parallel plan (AllReduceEP over the TP ranks), and the experts
# implementation each runs: batched_mm (each route gathers its expert's weights), or HF's default
# grouped_mm (the routes sorted by local id, rules/sorted_rows.lp)
EP_EXPERTS = {"ep": "batched_mm", "ep_train": "batched_mm", "ep_grouped": "grouped_mm", "ep_grouped_train": "grouped_mm",
              "ep_a2a": "grouped_mm", "ep_a2a_train": "grouped_mm", "ep_a2a_batched": "batched_mm",
              "ep_a2a_batched_train": "batched_mm"}
EP_DISPATCH = {step: "all_to_all" for step in EP_EXPERTS if step.startswith("ep_a2a")}  # (the others: HF's AllReduceEP)
EP_STEPS = tuple(EP_EXPERTS)


def _one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    error = [ln for ln in lines if ln.startswith("refine: error:")]
    line = (error or lines or [""])[-1]
    return " ".join(line.removeprefix("refine: error: ").split())[:300]


def is_moe_type(model_type: str) -> bool:
    """Whether the type's shipped plan shards experts (HF's expert styles)."""
    from refine.exporters.frameworks.transformers_configs import MOE_STYLES, shipped_plan

    return bool(MOE_STYLES & set((shipped_plan(model_type) or {}).values()))


def rows_of_results(path: Path) -> list[Row]:
    """The rows of this benchmark's table in a RESULTS.md (an earlier run's, to resume from)."""
    text = path.read_text()
    match = re.search(rf"^{re.escape(SECTION)}\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    rows = []
    for line in (match.group(1) if match else "").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 9 or not cells[2].isdigit():
            continue
        model_type, step, tp, exported, checked, verdict, export_s, verify_s, reason = cells
        rows.append(Row(model_type, int(tp), step, exported == "yes", None if not checked else checked == "passed",
                        "" if verdict == "-" else verdict, float(export_s), float(verify_s), reason,
                        moe=step in EP_STEPS or is_moe_type(model_type)))
    return rows


def check_failure(check_output: str) -> str:
    """What a failed `--check` says: the sequential program differs from torch's model (an export
    defect), or the TP programs, captured from torch's own TP run, differ from the sequential one."""
    failed = [ln for ln in check_output.splitlines() if ln.startswith("FAIL")]
    if any("seq.onnx vs torch" in ln for ln in failed):
        return "--check FAILED (the sequential program differs from torch's model: an export defect)"
    return "--check FAILED (torch's TP run disagrees)"


def run_row(model_type: str, tp: int, step: str, root: Path, timeout: float) -> Row:
    """Export (with --check) and verify one model type at one TP degree and step."""
    from refine.exporters.errors import ExportError
    from refine.exporters.frameworks.transformers_configs import TINY, validate

    row = Row(model_type, tp, step, moe=is_moe_type(model_type) or step in EP_STEPS)
    train, ep = step.endswith("train"), step in EP_STEPS
    experts = EP_EXPERTS.get(step)
    try:
        validate(model_type, TINY, tp, train=train, ep=tp if ep else None, experts=experts,
                 ep_implementation=EP_DISPATCH.get(step))
    except ExportError as exc:  # (refused before any export: no process needed)
        row.reason = " ".join(str(exc).split())[:300]
        return row
    except Exception as exc:  # noqa: BLE001 - a refine defect: this row says so, the sweep goes on
        row.reason = f"refine crashed validating it: {type(exc).__name__}: {' '.join(str(exc).split())[:250]}"
        return row
    out = root / f"{model_type}_tp{tp}_{step}"
    args = [*REFINE, "export", "--framework", "transformers", "--model-type", model_type, "--tp", str(tp),
            "--out", str(out), "--check", *(["--train"] if train else []),
            *(["--ep", str(tp), "--experts", experts] if experts else []),
            *(["--ep-implementation", EP_DISPATCH[step]] if step in EP_DISPATCH else [])]
    start = time.perf_counter()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        row.export_s, row.reason = time.perf_counter() - start, f"export timed out after {timeout:.0f} s"
        return row
    row.export_s = time.perf_counter() - start
    if not (out / "refine.json").is_file():
        row.reason = _one_line(done.stdout + done.stderr)
        return row
    row.exported, row.checked = True, done.returncode == 0
    start = time.perf_counter()
    report_path = out / "report.json"
    try:
        verified = subprocess.run([*REFINE, "verify", str(out), "--json", str(report_path)], capture_output=True,
                                  text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        row.verify_s, row.verdict, row.reason = time.perf_counter() - start, "timeout", f"verify over {timeout:.0f} s"
        return row
    row.verify_s = time.perf_counter() - start
    try:
        report = json.loads(report_path.read_text())
        row.verdict = report.get("verdict", "error")
    except (OSError, ValueError):
        row.verdict, row.reason = "error", _one_line(verified.stdout + verified.stderr)
        return row
    if row.verdict != "verified":
        lines = verified.stdout.splitlines()
        row.reason = " ".join((next((ln for ln in lines if "what is wrong" in ln or "first failure" in ln), "")).split())[:300]
    if not row.checked:
        row.reason = (check_failure(done.stdout) + ": " + row.reason).strip()
    return row


def table(rows: list[Row]) -> str:
    """The per-type table (markdown), and the totals the issue asks for."""
    head = ["| model type | step | TP | exported | --check | verdict | export s | verify s | reason |",
            "|---|---|---|---|---|---|---|---|---|"]
    body = [f"| {r.model_type} | {r.step} | {r.tp} | {'yes' if r.exported else 'no'} | "
            f"{'' if r.checked is None else 'passed' if r.checked else 'FAILED'} | {r.verdict or '-'} | "
            f"{r.export_s:.0f} | {r.verify_s:.0f} | {r.reason.replace('|', '/')} |" for r in rows]
    return "\n".join(head + body)


def _pct(part: int, whole: int) -> str:
    return f"{100 * part / max(1, whole):.0f}%"


# reasons that take a row out of the denominator: nothing to build from the config, or no
# loss to train (a base model's forward only), or a config class that refuses tiny sizes
NO_MODEL = ("no causal-LM class", "neither a causal-LM class nor a base model class", "has no token vocabulary")
NO_CONFIG = "does not build with tiny sizes"


def totals(rows: list[Row]) -> str:
    """Counts over the rows whose config builds and has a plan (the issue's denominator), all of
    them and the dense ones (mixture-of-experts types are issue 42's)."""
    lines = []
    for step in sorted({r.step for r in rows}):
        for tp in sorted({r.tp for r in rows}):
            sel = [r for r in rows if r.step == step and r.tp == tp]
            if not sel:
                continue
            no_model = [r for r in sel if any(words in r.reason for words in NO_MODEL)]
            config = [r for r in sel if NO_CONFIG in r.reason]
            base = [r for r in sel if r not in no_model and r not in config]
            moe = [r for r in base if r.moe or "mixture-of-experts" in r.reason]
            dense = [r for r in base if r not in moe]

            def counts(part: list[Row]) -> str:
                exported = [r for r in part if r.exported]
                verified = [r for r in exported if r.verdict == "verified"]
                confirmed = [r for r in exported if r.verdict == "refuted" and not r.checked]
                return (f"{len(exported)} of {len(part)} exported ({_pct(len(exported), len(part))}), "
                        f"{len(verified)} VERIFIED, {len(confirmed)} REFUTED with --check confirming "
                        f"({_pct(len(verified) + len(confirmed), len(part))} verified or confirmed)")

            lines.append(
                f"- {step}, TP {tp}: {len(sel)} model types with a plan; {len(config)} whose tiny config does not build, "
                f"{len(no_model)} with no model to {'train' if step.endswith('train') else 'build'} (no causal-LM class"
                f"{'' if step.endswith('train') else ' nor base model'}); of the other {len(base)}: {counts(base)}; "
                f"{len(moe)} of them mixture-of-experts: {counts(moe)}. Dense only: {counts(dense)}.")
    return "\n".join(lines)


def write_section(text: str, path: Path = RESULTS) -> None:
    """Replace this benchmark's section of RESULTS.md (up to the next `## ` heading), or append it."""
    old = path.read_text()
    pattern = re.compile(rf"^{re.escape(SECTION)}\n.*?(?=^## |\Z)", re.DOTALL | re.MULTILINE)
    new = pattern.sub(lambda _m: text.rstrip("\n") + "\n\n", old, count=1) if pattern.search(old) else old.rstrip("\n") + "\n\n" + text
    path.write_text(new.rstrip("\n") + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: every type with a plan)")
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--steps", nargs="+", default=["infer"], choices=["infer", "train", *EP_STEPS])
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per export and per verify")
    parser.add_argument("--json", type=Path, help="write the rows here (after each row)")
    parser.add_argument("--resume", type=Path, help="rows of an earlier --json run, or the table of a RESULTS.md: "
                                                    "those are not run again")
    parser.add_argument("--again", action="store_true", help="run the chosen rows even where --resume holds them")
    parser.add_argument("--keep", type=Path, help="export into this directory (kept) instead of a temporary one")
    parser.add_argument("--write", action="store_true", help=f"replace the section '{SECTION}' of {RESULTS.name}")
    parser.add_argument("--table-only", action="store_true",
                        help="run nothing: the table of the --resume rows (after runs of several selections)")
    args = parser.parse_args()
    from refine.exporters.frameworks.transformers_configs import model_types_with_ep_plan, model_types_with_plan

    types = [] if args.table_only else args.types.split(",") if args.types else model_types_with_plan()
    with_ep = set(model_types_with_ep_plan())
    done = {}
    if args.resume and args.resume.is_file():
        resumed = (rows_of_results(args.resume) if args.resume.suffix == ".md"
                   else [Row(**r) for r in json.loads(args.resume.read_text())])
        done = {r.key: r for r in resumed}
    rows: list[Row] = []  # (every resumed row is kept, chosen or not: runs of several selections add up)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="refine-hf-") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        for step in args.steps:
            for tp in args.tp:
                for model_type in types:
                    if step in EP_STEPS and model_type not in with_ep:
                        continue  # (no expert-parallel plan to run)
                    resumed = done.pop((model_type, tp, step), None)
                    row = resumed if resumed is not None and not args.again else run_row(model_type, tp, step, root,
                                                                                          args.timeout)
                    rows.append(row)
                    print(f"{model_type} {step} tp{tp}: {'exported' if row.exported else 'not exported'} "
                          f"{row.verdict} {row.export_s:.0f}+{row.verify_s:.0f}s {row.reason[:120]}", file=sys.stderr,
                          flush=True)
                    if args.json:
                        args.json.write_text(json.dumps([asdict(r) for r in [*rows, *done.values()]], indent=1))
    rows = sorted([*rows, *done.values()], key=lambda r: (r.step, r.tp, r.model_type))
    from refine.version import installed

    summed = sum(r.export_s + r.verify_s for r in rows)
    header = (f"{datetime.date.today().isoformat()}, {platform.machine()}, {os.cpu_count()} cores, transformers "
              f"{installed('transformers')}, torch {installed('torch')}: `python benchmarks/transformers_plans.py "
              f"{' '.join(a for a in sys.argv[1:] if a != '--write')}`, {time.perf_counter() - start:.0f} s wall "
              f"({summed:.0f} s of export and verify summed over the {len(rows)} rows, with those of the --resume "
              "file). Each row: `refine export --framework transformers --model-type T --tp N --check` (a tiny "
              "config, HF's plan as shipped) and `refine verify`.")
    text = "\n".join([SECTION, "", header, "", totals(rows), "", table(rows), ""])
    print(text)
    if args.write:
        write_section(text)
        print(f"wrote the section '{SECTION}' of {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
