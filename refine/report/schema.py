"""The report's schema: what one verification says, as pydantic models.

JSON users and `docs/report.schema.json` (generated from `Report`) depend on these models, so
they change only on purpose. Three verdicts, kept apart:

- `verified`: lemmas rebuild every sequential output from the ranks' outputs (a replica, a
  concatenation, a sum or max of partials).
- `refuted`: the lemmas do not prove it AND a numeric counterexample confirms a real bug: on
  inputs satisfying the declared input relations, no reconstruction of some sequential output
  from the ranks' outputs matches, or the programs cannot run together (mismatched collective
  calls, a deadlock). Only refine/diagnose/counterexample.py sets it.
- `unproven`: the lemmas do not prove it and there is no counterexample (the numbers agree, or
  were not checked): a gap in the lemma library, never called a bug.

refine/diagnose/diagnosis.py fills a Report in from the fixpoint; refine/diagnose/counterexample.py adds
`Report.numeric`; refine/report/render.py prints it (text, JUnit, HTML).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

Verdict = Literal["verified", "refuted", "unproven"]


class OutputResult(BaseModel):
    """One sequential output and how it is rebuilt from rank outputs (if it is)."""

    name: str
    ok: bool
    reconstruction: str | None = None


class InputRelation(BaseModel):
    """What one input of the failing node relates to on one rank."""

    input: str
    rank: int
    rank_tensor: str
    layout: str


class Location(BaseModel):
    module: str = ""
    file: str = ""
    line: int = 0


class RankNode(BaseModel):
    rank: int
    node: str
    op: str
    location: Location | None = None


class CollectiveMember(BaseModel):
    """One member's side of a collective call (node None: this member never makes the call)."""

    rank: int
    node: str | None = None
    op: str | None = None
    signature: str | None = Field(default=None, description="op, version and attributes; must agree across members")
    location: Location | None = None
    input: str | None = None
    input_relation: str | None = Field(default=None, description="how the member's input relates to a sequential tensor")
    output: str | None = None


class CollectiveCall(BaseModel):
    """A collective call near the failure: the k-th call on a group, matched on every member."""

    group: list[int]
    call: int = Field(description="call number within the group (calls are matched by group and order)")
    kind: str
    matched: bool = Field(description="every member makes this call with the same op and attributes")
    problem: str | None = None
    members: list[CollectiveMember] = Field(default_factory=list)
    mesh_group: str | None = Field(default=None, description="the group in mesh coordinates (`the tp group of dp=1`)")
    fits: list[int] | None = Field(default=None, description="the ranks holding the pieces the first member's input "
                                   "is one of, where they are not this group (a reduction over the wrong group)")
    fits_mesh_group: str | None = None


class GraphNode(BaseModel):
    id: str
    label: str
    op: str
    role: Literal["failing", "culprit", "match", "context", "input", "output"] = Field(
        description="failing: the sequential node; culprit: the rank-side node the diagnosis names; match: a rank node computing the same op")
    location: str | None = None


class GraphEdge(BaseModel):
    src: str
    dst: str
    tensor: str
    layout: str | None = Field(default=None, description="relation of the tensor (seq: per rank; rank: to a seq tensor)")


class GraphExcerpt(BaseModel):
    """A few nodes around the failure in one graph (seq or one rank), for the HTML page."""

    graph: str
    rank: int = Field(description="-1 for the sequential graph")
    nodes: list[GraphNode] = Field(default_factory=list)
    edges: list[GraphEdge] = Field(default_factory=list)


class Premise(BaseModel):
    """How far one rule got: how many premises of its body held, and the first that did not."""

    rule: str = Field(description="the lemma's name, or a helper predicate as name/arity")
    file: str = Field(description="the rule file, e.g. rules/elementwise.lp")
    line: int
    matched: int = Field(description="premises that held (with the failing node bound)")
    premises: int = Field(description="premises in the rule's body, plus the shape guard a lemma's result must pass")
    missing: str | None = Field(default=None, description="the first premise that did not hold, with the values it "
                                                          "was asked with (clingo syntax; open variables by name)")
    words: str = Field(default="", description="the missing premise in words, and what holds instead")


class NearLemma(Premise):
    """A lemma that came near, and the helper rules explaining its missing premise."""

    because: list[Premise] = Field(default_factory=list, description="the missing premise explained by the helper "
                                                                      "rules defining it, outermost first")


class ClosestLemma(NearLemma):
    """The lemma that came closest to relating the failing node's output: the most premises on
    relations held with the node bound to the failing one (a lemma whose body held and only the
    shape guard refused comes first). Found by asking clingo about prefixes of each rule's body
    (refine/diagnose/closest.py); an explanation only, never a verdict."""

    rank_node: str | None = Field(default=None, description="the rank node the lemmas were tried with (r1:...): one that "
                                                             "computes the failing node's op, whose output relates to nothing")
    others: list[NearLemma] = Field(default_factory=list, description="the next closest lemmas")
    tried: int = Field(default=0, description="rules tried")


class Failure(BaseModel):
    """The first sequential node where reconstruction breaks, and why."""

    node: str
    op: str
    location: Location | None = None
    reason: str
    rules_file: str | None = Field(default=None, description="lemma file a rule author would extend")
    inputs: list[InputRelation] = Field(default_factory=list)
    unrelated_inputs: list[str] = Field(default_factory=list)
    rank_nodes: list[RankNode] = Field(default_factory=list)
    collectives: list[CollectiveCall] = Field(default_factory=list, description="collective calls feeding or fed by this node's rank counterparts")
    neighbourhood: list[GraphExcerpt] = Field(default_factory=list)
    closest: ClosestLemma | None = Field(default=None, description="the lemma that came closest, and the premise that did not hold")


class Diagnosis(BaseModel):
    """What is wrong, in plain words: the bug pattern the failure shows (refine/diagnose/plain.py)."""

    pattern: str = Field(description="missing_allreduce, replica_before_allreduce, wrong_collective, extra_factor, reshape_moves_shard, wrong_offset, ring_block_operand, ring_merge, ring_rescale, ring_finish")
    bug_class: int | None = Field(default=None, description="its class in docs/bugs.md")
    summary: str = Field(description="one sentence: what the ranks do wrong, the rank-side node and its source line")
    rank_node: str | None = Field(default=None, description="the rank-side node where the bug is")
    location: Location | None = None


class FailureGroup(BaseModel):
    """Other failing sequential nodes with one op and one cause (bounded output on big models)."""

    op: str
    cause: str
    count: int
    nodes: list[str] = Field(default_factory=list, description="the first few, in topological order")


class Coordinate(BaseModel):
    index: list[int]
    expected: float = Field(description="the sequential value")
    got: float = Field(description="the value rebuilt from the ranks")


class CandidateResult(BaseModel):
    """One way of rebuilding a sequential tensor from rank tensors, and how far off it is."""

    candidate: str
    shape: list[int]
    max_abs_error: float | None = Field(default=None, description="None: the shape differs")
    max_rel_error: float | None = Field(default=None, description="max abs error / max |sequential value|")
    matches: bool = False


class ValueComparison(BaseModel):
    """A sequential tensor against every candidate reconstruction from rank tensors."""

    seq_tensor: str
    seq_node: str | None = None
    shape: list[int]
    matches: bool
    best: CandidateResult | None = None
    runners_up: list[CandidateResult] = Field(default_factory=list)
    candidates_tried: int = 0
    allowed_error: float = Field(default=0.0, description="a candidate matches if its max abs error is at most this")
    coordinates: list[Coordinate] = Field(default_factory=list, description="where the best candidate is furthest off")
    note: str = ""


NumericStatus = Literal["counterexample", "program_error", "agrees", "inconclusive", "not_run"]


class NumericCheck(BaseModel):
    """The simulation after a failed proof: a counterexample, agreement, or why there is neither."""

    status: NumericStatus
    summary: str
    seeds: list[int] = Field(default_factory=list)
    seed: int | None = Field(default=None, description="the seed of the counterexample")
    tolerance: float = Field(default=1e-4, description="match if max abs error <= tolerance * max(1, max |expected|)")
    output: ValueComparison | None = Field(default=None, description="the sequential output no reconstruction matches")
    at_node: ValueComparison | None = Field(default=None, description="values at the failing node")
    simulation_error: str | None = None
    reduced_config: str | None = Field(default=None, description="the check ran on the same export at this reduced "
                                                                 "config (the real sizes exceed --sim-memory)")
    seconds: float = 0.0


class RuleViolation(BaseModel):
    """A derived relation the numbers contradict."""

    seq_tensor: str
    rank_tensors: list[str]
    layout: str
    lemmas: list[str] = Field(description="the lemmas that derived it")
    max_abs_error: float
    instance: str = Field(description="what it was found on: a generated instance or an example model")
    saved: str | None = Field(default=None, description="the instance as a model directory, to debug with --rules")


class LemmaTally(BaseModel):
    lemma: str
    fired: int = Field(0, description="instances where the lemma derived a relation")
    held: int = Field(0, description="of its relations, how many held on the numbers")
    violated: int = 0


class RuleCheck(BaseModel):
    """Lemmas checked on numbers (refine/kit/rulecheck.py): what `refine rules check` found, or, in a
    report, the relations the user's lemmas (`--rules`) derived on the model itself."""

    status: Literal["held", "violated", "not_run"]
    summary: str
    instances: int = 0
    checked: int = Field(0, description="relations checked numerically")
    lemmas: list[LemmaTally] = Field(default_factory=list)
    violations: list[RuleViolation] = Field(default_factory=list)
    not_exercised: list[str] = Field(default_factory=list, description="user lemmas no instance made fire")
    unsupported_ops: list[str] = Field(default_factory=list, description="ops the generator cannot make instances of")
    unstratified: list[str] = Field(default_factory=list, description=(
        "rules of the user's files that negate or aggregate over a predicate of their own recursion, with the "
        "bundled library (refine/kit/stratification.py): clingo then grounds the whole cycle for its solver, slowly"))


class Suggestion(BaseModel):
    """`refine rules suggest`: a candidate lemma read off the numbers at an unproven node
    (refine/kit/suggest.py), checked, never applied silently."""

    status: Literal["proposed", "refused", "nothing", "not_unproven"] = Field(
        description="proposed: lemmas that held on the numbers, that `rules check` accepts and with which the model "
                    "verifies; refused: `rules check` found instances against them, or the model still does not "
                    "verify; nothing: no layout rebuilds the output, or the numbers refute the model (a bug)")
    summary: str
    node: str | None = None
    op: str | None = None
    lemma: str | None = Field(default=None, description="the lemmas' text: each one's identity comment and rule")
    lemma_files: list[str] = Field(default_factory=list, description="one .lp file per lemma (one per node where the relations stopped)")
    witness: list[str] = Field(default_factory=list, description="model directories of each node alone, checked with the lemmas")
    witness_note: str | None = Field(default=None, description="why a witness model directory was not written")
    check: RuleCheck | None = Field(default=None, description="`refine rules check` on the suggestion's directory")
    verdict_with_it: str | None = Field(default=None, description="the model's verdict with the lemma added (--rules)")
    command: str | None = Field(default=None, description="the command that adopts it")


class ExplainStep(BaseModel):
    """One relation in a derivation chain: seq tensor ~ rank tensor by layout, derived by a lemma."""

    depth: int
    seq_tensor: str
    seq_node: str | None = None
    op: str | None = None
    location: Location | None = None
    rank: int | None = None
    rank_tensor: str | None = None
    rank_node: str | None = None
    rank_op: str | None = None
    layout: str | None = None
    lemmas: list[str] = Field(default_factory=list)
    note: str = ""


class Explanation(BaseModel):
    """How one sequential output is derived, walked back to the declared graph inputs."""

    output: str
    rebuilt: bool
    reconstruction: str | None = None
    steps: list[ExplainStep] = Field(default_factory=list)
    truncated: bool = False


class Report(BaseModel):
    """The result of one verification."""

    model: str
    verdict: Verdict
    world_size: int
    outputs: list[OutputResult]
    diagnosis: Diagnosis | None = Field(default=None, description="what is wrong, in plain words, where a known bug pattern fits the failure")
    failure: Failure | None = None
    other_failures: int = 0
    other_failure_groups: list[FailureGroup] = Field(default_factory=list)
    unrelated_inputs: list[str] = Field(default_factory=list)
    collective_mismatches: list[str] = Field(default_factory=list)
    sanity_violations: list[str] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list, description="what looks wrong about the inputs whatever the verdict: "
                                "ranks that make no collective although refine.json splits their weights (refine/diagnose/silent.py)")
    numeric: NumericCheck | None = None
    rule_check: RuleCheck | None = Field(default=None, description="with --rules: every derived relation checked on a simulation of the model (a violation makes a proof unproven)")
    explanation: Explanation | None = None
    relations: int = 0
    rows: str | None = Field(default=None, description="a mesh whose rows run the same programs on their own batch chunks: "
                             "verified on its first row, the others by symmetry (docs/rows.md); what it says, in words")
    memo: dict[str, int] | None = Field(default=None, description="layer memoization: layer_calls, templates, template_solves, main_solves, elided_calls (left out of the last main solve, instantiated along their chain), copied_outputs (graph outputs of those calls checked once per class, docs/layers.md), solved_ahead and wasted_solves (with --jobs N: template solves a worker or a wait had ready when needed, and solves of guessed keys no walk met), aliased (layer keys read off the solve of the same template on other ranks, a later pipeline stage's: refine/run/stage_symmetry.py)")
    lower_seconds: float = 0.0
    run_seconds: float = 0.0

    @property
    def exit_code(self) -> int:
        """0 verified, 1 refuted, 3 unproven (2 is bad input, raised before any report)."""
        return {"verified": 0, "refuted": 1}.get(self.verdict, 3)


def write_json(report: Report, path: Path) -> None:
    """Write the report as JSON atomically (never a half-written file)."""
    write_atomic(path, json.dumps(report.model_dump(mode="json"), indent=2) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Write a file atomically: a temporary file beside it, renamed over it; on failure the
    temporary file is removed (OSError raised), so nothing half-written stays behind."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
