"""Bad input never crashes: one line `refine: error: <file>: <problem>` on stderr, exit code 2.

Every case copies a good example directory into tmp_path and breaks exactly one thing. The
line must name the file at fault (the exact path refine was given, joined with the file name),
there must be no traceback, and nothing may be written half-way (`lower --out`, `--json`).
"""

from __future__ import annotations

import json

import numpy as np
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from refine import dist
from refine.cli.main import app

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


# --- helpers -------------------------------------------------------------------------------


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def assert_bad(result, file: Path | str) -> str:
    """Exit 2, exactly one stderr line `refine: error: <file>: <problem>`, no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    prefix = f"refine: error: {file}: "
    assert lines[0].startswith(prefix), (lines[0], prefix)
    assert lines[0][len(prefix):].strip(), "the problem must be stated"
    assert "Traceback" not in result.output
    print(lines[0])
    return lines[0]


def copy_example(tmp_path: Path, name: str = "mlp_tp2") -> Path:
    d = tmp_path / name
    shutil.copytree(EXAMPLES / name, d)
    return d


def edit_config(d: Path, fn: Callable[[dict], None]) -> None:
    path = d / "refine.json"
    cfg = json.loads(path.read_text())
    fn(cfg)
    path.write_text(json.dumps(cfg))


def edit_model(path: Path, fn: Callable[[onnx.ModelProto], None]) -> None:
    model = onnx.load(str(path))
    fn(model)
    onnx.save(model, str(path))  # no checker: the point is to write broken models


def collective(model: onnx.ModelProto) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.domain == dist.DIST_DOMAIN)


def set_meta(key: str, value: str) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        for p in model.metadata_props:
            if p.key == key:
                p.value = value
                return
        model.metadata_props.add(key=key, value=value)

    return fn


def set_group(group: list[int]) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        node = collective(model)
        for a in node.attribute:
            if a.name == "group":
                del a.ints[:]
                a.ints.extend(group)

    return fn


def verify_bad(d: Path, file: Path | str) -> str:
    return assert_bad(invoke("verify", d), file)


# --- unreadable ONNX files -----------------------------------------------------------------


def test_corrupt_onnx(tmp_path):
    d = copy_example(tmp_path)
    (d / "rank1.onnx").write_bytes(random.Random(0).randbytes(3000))
    verify_bad(d, d / "rank1.onnx")


def test_truncated_onnx(tmp_path):
    d = copy_example(tmp_path)
    data = (d / "seq.onnx").read_bytes()
    (d / "seq.onnx").write_bytes(data[: len(data) // 2])
    verify_bad(d, d / "seq.onnx")


@pytest.mark.parametrize(
    "content",
    [b"this is not an ONNX model\n", b"", b'{"world_size": 2}\n', b"\x89PNG\r\n\x1a\n" + bytes(64)],
    ids=["text", "empty", "json", "png"],
)
def test_non_onnx_file(tmp_path, content):
    d = copy_example(tmp_path)
    (d / "rank0.onnx").write_bytes(content)
    verify_bad(d, d / "rank0.onnx")


def test_onnx_file_is_a_directory(tmp_path):
    d = copy_example(tmp_path)
    (d / "rank0.onnx").unlink()
    (d / "rank0.onnx").mkdir()
    verify_bad(d, d / "rank0.onnx")


# --- missing files -------------------------------------------------------------------------


def test_missing_rank_file(tmp_path):
    d = copy_example(tmp_path)
    (d / "rank1.onnx").unlink()
    verify_bad(d, d / "rank1.onnx")


def test_missing_seq(tmp_path):
    d = copy_example(tmp_path)
    (d / "seq.onnx").unlink()
    verify_bad(d, d / "seq.onnx")


def test_missing_config(tmp_path):
    d = copy_example(tmp_path)
    (d / "refine.json").unlink()
    verify_bad(d, d / "refine.json")


def test_nonexistent_model_dir(tmp_path):
    assert_bad(invoke("verify", tmp_path / "nope"), tmp_path / "nope")
    assert_bad(invoke("lower", tmp_path / "nope", "--out", tmp_path / "f"), tmp_path / "nope")
    assert not (tmp_path / "f").exists()


def test_model_dir_is_a_file(tmp_path):
    (tmp_path / "m").write_text("x")
    assert_bad(invoke("verify", tmp_path / "m"), tmp_path / "m")


def test_nonexistent_model_dir_subprocess(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "refine.cli.main", "verify", str(tmp_path / "nope")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"refine: error: {tmp_path / 'nope'}: "), proc.stderr


def test_corrupt_onnx_subprocess(tmp_path):
    d = copy_example(tmp_path)
    (d / "rank0.onnx").write_bytes(b"\x08\x07\x12garbage" * 50)
    proc = subprocess.run(
        [sys.executable, "-m", "refine.cli.main", "verify", str(d)], capture_output=True, text=True
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"refine: error: {d / 'rank0.onnx'}: "), proc.stderr


# --- refine.json ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "{not json",
        "[1, 2]",
        '{"inputs": {}}',
        '{"world_size": 0}',
        '{"world_size": "two"}',
        '{"world_size": 2, "colour": "red"}',
        '{"world_size": 2, "inputs": {"x": {"layout": "diagonal"}}}',
        '{"world_size": 2, "inputs": {"x": {"layout": "shard"}}}',
        '{"world_size": 2, "inputs": {"x": {"layout": "shard", "axis": 0, "sizes": [1, 1, 0]}}}',
        '{"world_size": 2, "inputs": {"x": {"layout": "partial", "op": "prod"}}}',
        "\xff\xfe",
    ],
    ids=[
        "not-json", "list", "no-world-size", "world-size-0", "world-size-str", "extra-key",
        "unknown-layout", "shard-no-axis", "sizes-vs-world", "partial-op", "binary",
    ],
)
def test_invalid_config(tmp_path, text):
    d = copy_example(tmp_path)
    (d / "refine.json").write_bytes(text.encode("latin-1"))
    verify_bad(d, d / "refine.json")


@pytest.mark.parametrize(("edit", "why"), [
    (lambda c: c.update(mesh={"shape": [2, 3], "dims": ["pp", "tp"]}), "mesh shape [2, 3] has 6 ranks, world_size is 4"),
    (lambda c: c.update(mesh={"shape": [2, 2], "dims": ["tp", "tp"]}), "name one dimension twice"),
    (lambda c: c.update(mesh={"shape": [4], "dims": ["pp", "tp"]}), "2 dims"),
    (lambda c: c["inputs"]["layers.0.mlp.up_proj.weight"].update(over="dp"), "over 'dp' names none of the mesh dims"),
    (lambda c: c.pop("mesh"), "names none of no mesh"),
    (lambda c: c["inputs"]["layers.0.mlp.up_proj.weight"].update(sizes=[16, 16, 16, 16]), "4 shard sizes for 2 ranks along mesh dim 'tp'"),
    (lambda c: c["outputs"]["y"].update(layout="partial", over="tp"), "`over` is for inputs and sharded outputs only"),
])
def test_invalid_mesh(tmp_path, edit, why):
    """A mesh that does not fit the world, or a layout over a dim it does not have: one line, exit 2."""
    d = copy_example(tmp_path, "mlp_tp2_pp2")
    edit_config(d, edit)
    assert why in verify_bad(d, d / "refine.json")


def test_pipeline_output_pieces_must_all_be_there(tmp_path):
    """A replica may live on the last stage only; a sharded output needs every rank's piece."""
    d = copy_example(tmp_path, "mlp_tp2_pp2")
    edit_config(d, lambda c: c["outputs"].update(y={"layout": "shard", "axis": 0}))
    assert "has no output 'y'" in verify_bad(d, d / "rank0.onnx")


# --- world size ----------------------------------------------------------------------------


def test_world_size_smaller_than_rank_files(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c.update(world_size=1))
    verify_bad(d, d / "rank1.onnx")


def test_world_size_larger_than_rank_files(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c.update(world_size=3))
    verify_bad(d, d / "rank2.onnx")


def test_world_size_huge(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c.update(world_size=10**12))
    verify_bad(d, d / "rank2.onnx")


def test_rank_metadata_world_size(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank1.onnx", set_meta("world_size", "4"))
    verify_bad(d, d / "rank1.onnx")


def test_seq_metadata_world_size(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "seq.onnx", set_meta("world_size", "4"))
    verify_bad(d, d / "seq.onnx")


def test_rank_metadata_rank(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank0.onnx", set_meta("rank", "1"))
    verify_bad(d, d / "rank0.onnx")


def test_rank_files_swapped(tmp_path):
    d = copy_example(tmp_path)
    (d / "rank0.onnx").rename(d / "tmp.onnx")
    (d / "rank1.onnx").rename(d / "rank0.onnx")
    (d / "tmp.onnx").rename(d / "rank1.onnx")
    verify_bad(d, d / "rank0.onnx")


# --- collectives ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["Scatter", "Foo"])
def test_unknown_dist_op(tmp_path, op):
    d = copy_example(tmp_path)

    def fn(model: onnx.ModelProto) -> None:
        collective(model).op_type = op

    edit_model(d / "rank1.onnx", fn)
    line = verify_bad(d, d / "rank1.onnx")
    assert f"dist.{op}" in line


@pytest.mark.parametrize(("op", "attrs", "why"), [
    ("Send", {"peer": 5}, "peer 5 is outside 0..1 (world_size 2)"),
    ("Recv", {"peer": 1}, "rank 1 names itself as its peer"),
    ("Send", {"peer": 0, "tag": -2}, "tag -2 is negative"),
    ("Broadcast", {"root": 3, "group": [0, 1]}, "root 3 is not in its group [0, 1]"),
])
def test_malformed_point_to_point_and_broadcast(tmp_path, op, attrs, why):
    """A call that no run could make: one line naming the file and the node, exit 2."""
    d = copy_example(tmp_path)

    def fn(model: onnx.ModelProto) -> None:
        node = collective(model)
        node.op_type = op
        del node.attribute[:]
        node.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())

    edit_model(d / "rank1.onnx", fn)
    line = verify_bad(d, d / "rank1.onnx")
    assert why in line


def test_group_without_calling_rank(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank1.onnx", set_group([0]))
    verify_bad(d, d / "rank1.onnx")


@pytest.mark.parametrize("group", [[0, 2], [0, -1], [0, 0, 1], []], ids=["past-world", "negative", "twice", "empty"])
def test_group_bad_members(tmp_path, group):
    d = copy_example(tmp_path)
    edit_model(d / "rank0.onnx", set_group(group))
    verify_bad(d, d / "rank0.onnx")


def test_unknown_reduce_op(tmp_path):
    d = copy_example(tmp_path)

    def fn(model: onnx.ModelProto) -> None:
        for a in collective(model).attribute:
            if a.name == "reduce_op":
                a.s = b"prod"

    edit_model(d / "rank0.onnx", fn)
    verify_bad(d, d / "rank0.onnx")


# --- declared inputs -----------------------------------------------------------------------


def _add_input(model: onnx.ModelProto) -> None:
    model.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [4]))


def test_input_on_neither_side(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update(nope={"layout": "rep"}))
    line = verify_bad(d, d / "refine.json")
    assert "'nope'" in line


def test_input_only_on_seq(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "seq.onnx", _add_input)
    edit_config(d, lambda c: c["inputs"].update(extra={"layout": "rep"}))
    verify_bad(d, d / "refine.json")


def test_input_only_on_ranks(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank0.onnx", _add_input)
    edit_model(d / "rank1.onnx", _add_input)
    edit_config(d, lambda c: c["inputs"].update(extra={"layout": "rep"}))
    verify_bad(d, d / "refine.json")


def test_declared_name_is_not_an_input(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update({"mlp.up_proj/MatMul_output_0": {"layout": "rep"}}))
    verify_bad(d, d / "refine.json")


def test_shard_does_not_divide(tmp_path):
    d = copy_example(tmp_path, "mlp_tp8")  # batch 2 over 8 ranks
    edit_config(d, lambda c: c["inputs"].update(x={"layout": "shard", "axis": 0}))
    verify_bad(d, d / "refine.json")


def test_shard_sizes_do_not_add_up(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update({"mlp.up_proj.bias": {"layout": "shard", "axis": 0, "sizes": [30, 30]}}))
    verify_bad(d, d / "refine.json")


def test_shard_axis_out_of_range(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update({"mlp.up_proj.bias": {"layout": "shard", "axis": 3}}))
    verify_bad(d, d / "refine.json")


@pytest.mark.parametrize("layout,words", [
    ({"layout": "rep", "also": [-100]}, "`also` adds values to a range"),
    ({"layout": "rep", "range": [3, 3]}, "is empty"),
])
def test_declared_values_without_a_range(tmp_path, layout, words):
    """Values declared besides a range need the range; an empty range is refused."""
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update(x=layout))
    assert words in verify_bad(d, d / "refine.json")


def test_rank_shape_inconsistent_with_layout(tmp_path):
    d = copy_example(tmp_path)
    edit_config(d, lambda c: c["inputs"].update({"mlp.down_proj.bias": {"layout": "shard", "axis": 0}}))
    line = verify_bad(d, d / "rank0.onnx")
    assert "mlp.down_proj.bias" in line


# --- graph structure -----------------------------------------------------------------------


def _cyclic_model(like: onnx.ModelProto) -> onnx.ModelProto:
    """x -> Add(x, b) -> a -> Relu -> b: a cycle through a and b; output y = Identity(b)."""
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="add"),
        helper.make_node("Relu", ["a"], ["b"], name="relu"),
        helper.make_node("Identity", ["b"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes, "cyclic", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 16])],
    )
    model = helper.make_model(graph, opset_imports=list(like.opset_import), ir_version=like.ir_version)
    model.metadata_props.extend(like.metadata_props)
    return model


@pytest.mark.parametrize("which", ["seq.onnx", "rank1.onnx"])
def test_cyclic_graph(tmp_path, which):
    d = copy_example(tmp_path)
    model = _cyclic_model(onnx.load(str(d / which)))
    (d / which).write_bytes(model.SerializeToString())  # bypasses onnx.checker
    edit_config(d, lambda c: c.update(inputs={"x": {"layout": "rep"}}))
    line = verify_bad(d, d / which)
    assert "cycle" in line


def test_self_loop(tmp_path):
    d = copy_example(tmp_path)
    like = onnx.load(str(d / "seq.onnx"))
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["y"], name="loop")], "self",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 16])],
    )
    model = helper.make_model(graph, opset_imports=list(like.opset_import), ir_version=like.ir_version)
    (d / "seq.onnx").write_bytes(model.SerializeToString())
    verify_bad(d, d / "seq.onnx")


def test_unsorted_graph(tmp_path):
    d = copy_example(tmp_path)

    def fn(model: onnx.ModelProto) -> None:
        nodes = list(model.graph.node)
        del model.graph.node[:]
        model.graph.node.extend(reversed(nodes))

    edit_model(d / "rank0.onnx", fn)
    verify_bad(d, d / "rank0.onnx")


def test_tensor_assigned_twice(tmp_path):
    d = copy_example(tmp_path)

    def fn(model: onnx.ModelProto) -> None:
        model.graph.node[1].output[0] = model.graph.node[0].output[0]

    edit_model(d / "seq.onnx", fn)
    line = verify_bad(d, d / "seq.onnx")
    assert "two nodes" in line


def test_collective_in_seq(tmp_path):
    d = copy_example(tmp_path)
    rank0 = onnx.load(str(d / "rank0.onnx"))

    def fn(model: onnx.ModelProto) -> None:
        del model.graph.node[:]
        model.graph.node.extend(rank0.graph.node)
        del model.opset_import[:]
        model.opset_import.extend(rank0.opset_import)

    edit_model(d / "seq.onnx", fn)
    verify_bad(d, d / "seq.onnx")


def _set_input(name: str, **change: object) -> Callable[[onnx.ModelProto], None]:
    def fn(model: onnx.ModelProto) -> None:
        vi = next(i for i in model.graph.input if i.name == name)
        if "elem_type" in change:
            vi.type.tensor_type.elem_type = change["elem_type"]
        if "dim_param" in change:
            vi.type.tensor_type.shape.dim[0].dim_param = change["dim_param"]

    return fn


def test_declared_input_dtype_differs(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank1.onnx", _set_input("x", elem_type=TensorProto.INT64))
    verify_bad(d, d / "rank1.onnx")


@pytest.mark.parametrize("which", ["seq.onnx", "rank1.onnx"])
def test_declared_input_dynamic_shape(tmp_path, which):
    d = copy_example(tmp_path)
    edit_model(d / which, _set_input("x", dim_param="N"))
    verify_bad(d, d / which)


# --- facts directories (`refine run --facts`) ----------------------------------------------


@pytest.fixture
def facts_dir(tmp_path) -> Path:
    out = tmp_path / "facts"
    result = invoke("lower", EXAMPLES / "mlp_tp2", "--out", out)
    assert result.exit_code == 0, result.output
    return out


def test_facts_dir_missing_file(facts_dir):
    (facts_dir / "node.facts").unlink()
    assert_bad(invoke("run", "--facts", facts_dir), facts_dir / "node.facts")


def test_facts_dir_nonexistent(tmp_path):
    assert_bad(invoke("run", "--facts", tmp_path / "nope"), tmp_path / "nope")


@pytest.mark.parametrize(
    "line",
    ["seq\tonly-two-columns", "seq\t\"t\"\tnot-an-int\t4", "seq)). bad(\tseq:x\t0\t2"],
    ids=["columns", "int", "clingo-syntax"],
)
def test_facts_dir_malformed_line(facts_dir, line):
    with (facts_dir / "dim.facts").open("a") as f:
        f.write(line + "\n")
    result = invoke("run", "--facts", facts_dir)
    # a line refine can see is wrong names dim.facts; one only clingo rejects names the directory
    file = facts_dir if "bad(" in line else facts_dir / "dim.facts"
    assert_bad(result, file)


def test_facts_dir_binary_file(facts_dir):
    (facts_dir / "dim.facts").write_bytes(b"\xff\xfe\x00garbage\n")
    assert_bad(invoke("run", "--facts", facts_dir), facts_dir / "dim.facts")


# --- rule directories (--rules) ------------------------------------------------------------


def test_rules_dir_missing(tmp_path):
    assert_bad(invoke("verify", EXAMPLES / "mlp_tp2", "--rules", tmp_path / "nope"), tmp_path / "nope")


def test_rules_dir_empty(tmp_path):
    (tmp_path / "rules").mkdir()
    assert_bad(invoke("verify", EXAMPLES / "mlp_tp2", "--rules", tmp_path / "rules"), tmp_path / "rules")


def test_rules_syntax_error(tmp_path, facts_dir):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "bad.lp").write_text("this is not( valid clingo\n")
    assert_bad(invoke("verify", EXAMPLES / "mlp_tp2", "--rules", rules), rules / "bad.lp")
    assert_bad(invoke("run", "--facts", facts_dir, "--rules", rules), rules / "bad.lp")


def test_rules_unsafe_variable(tmp_path):
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "unsafe.lp").write_text("handles(X, \"unsafe.lp\") :- not node(_, _, X).\n")
    result = invoke("verify", EXAMPLES / "mlp_tp2", "--rules", rules)
    assert_bad(result, rules / "unsafe.lp")


# --- nothing written half-way --------------------------------------------------------------


def test_lower_failure_writes_nothing(tmp_path):
    d = copy_example(tmp_path)
    edit_model(d / "rank1.onnx", set_group([0]))  # fails late: after seq and rank0 are lowered
    out_parent = tmp_path / "o"
    assert_bad(invoke("lower", d, "--out", out_parent / "facts"), d / "rank1.onnx")
    assert not out_parent.exists()
    out_parent.mkdir()
    assert_bad(invoke("lower", d, "--out", out_parent / "facts"), d / "rank1.onnx")
    assert list(out_parent.iterdir()) == []


def test_lower_out_is_a_file(tmp_path):
    (tmp_path / "f").write_text("keep me")
    assert_bad(invoke("lower", EXAMPLES / "mlp_tp2", "--out", tmp_path / "f"), tmp_path / "f")
    assert (tmp_path / "f").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_lower_out_will_not_replace_a_foreign_dir(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert_bad(invoke("lower", EXAMPLES / "mlp_tp2", "--out", out), out)
    assert (out / "notes.txt").read_text() == "keep me"


def test_json_not_written_on_error(tmp_path):
    d = copy_example(tmp_path)
    (d / "seq.onnx").write_bytes(b"junk")
    report = tmp_path / "report.json"
    assert_bad(invoke("verify", d, "--json", report), d / "seq.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == [d.name]


def test_json_into_missing_dir(tmp_path):
    report = tmp_path / "no" / "such" / "report.json"
    assert_bad(invoke("verify", EXAMPLES / "mlp_tp2", "--json", report), report)
    assert not (tmp_path / "no").exists()


# --- usage errors --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [[], ["verify"], ["lower", str(EXAMPLES / "mlp_tp2")], ["run"], ["frobnicate"], ["verify", "--bogus", "x"]],
    ids=["none", "verify", "lower-no-out", "run-no-facts", "unknown-command", "unknown-option"],
)
def test_usage_errors(args):
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output


def test_expand_to_a_target_it_cannot_broadcast_to(tmp_path):
    """ONNX's inference passes Expand(x[2, 3], Range(0, 2)) (a target [0, 1]) as [2, 3]; the
    program cannot run, and refine says so instead of relating its output (a mutant once
    verified that way)."""
    from refine.dist import dist_opset

    d = tmp_path / "expand"
    d.mkdir()
    ints = lambda name, v: helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [], [v]))  # noqa: E731
    seq = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "seq",
                            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])],
                            [onnx.numpy_helper.from_array(np.array([2, 6], dtype=np.int64), "shape")])
    rank = helper.make_graph([ints("a", 0), ints("b", 2), ints("c", 1), helper.make_node("Range", ["a", "b", "c"], ["shape"]),
                              helper.make_node("Expand", ["x", "shape"], ["y"], name="bad_expand")], "rank",
                             [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    onnx.save(helper.make_model(seq, opset_imports=[helper.make_opsetid("", 18)]), d / "seq.onnx")
    for r in range(2):
        onnx.save(helper.make_model(rank, opset_imports=[helper.make_opsetid("", 18), dist_opset()]), d / f"rank{r}.onnx")
    (d / "refine.json").write_text(json.dumps({"world_size": 2, "inputs": {"x": {"layout": "shard", "axis": 1}}}))
    line = verify_bad(d, d / "rank0.onnx")
    assert "ill-typed: node 'bad_expand' (Expand): input shape [2, 3] does not broadcast to [0, 1]" in line
