"""Soundness hardening (issue 11): what `refine` must never call verified, and what is bad input.

1. Shapes come from inference only: a declared shape (value_info, graph outputs, a layer
   function's value_info) that contradicts what the nodes compute is bad input, never trusted.
2. An output with no declared layout is rebuilt by every rank that has it, or not at all.
3. The counterexample search honours a declared output layout.
4. A node whose operands its op cannot take (an ill-typed model) is bad input.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from harness import invoke
from refine import dist
from refine.errors import InputError
from refine.pipeline import verify_dir

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def copy_example(name: str, to: Path) -> Path:
    out = to / name
    shutil.copytree(EXAMPLES / name, out)
    return out


def edit(path: Path, change) -> None:
    """Load an ONNX file, let `change(model)` edit it in place, save it back."""
    model = onnx.load(str(path))
    change(model)
    onnx.save(model, str(path))


def annotate(model: onnx.ModelProto) -> None:
    """Declare every intermediate's inferred type in value_info, as exporters do."""
    dist.register_schemas()
    model.graph.value_info.extend(onnx.shape_inference.infer_shapes(model).graph.value_info)


def set_initializer(model: onnx.ModelProto, name: str, value: list[int]) -> None:
    for init in model.graph.initializer:
        if init.name == name:
            init.CopyFrom(numpy_helper.from_array(np.array(value, dtype=np.int64), name))
            return
    raise KeyError(name)


def node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "refine.json").read_text())


def write_config(model_dir: Path, cfg: dict) -> None:
    (model_dir / "refine.json").write_text(json.dumps(cfg))


# --- 1. shapes the model only declares ---------------------------------------------------


def permute_rank0_heads(model_dir: Path, stale: bool) -> None:
    """rank0 reshapes q/k/v into [2, 4, 6, 4] instead of [2, 6, 4, 4] (heads and sequence
    swapped): with `stale`, its value_info still declares the shapes it had before."""

    def change(model: onnx.ModelProto) -> None:
        if stale:
            annotate(model)
        set_initializer(model, "self_attn.head_shape", [2, 4, 6, 4])

    edit(model_dir / "rank0.onnx", change)


@pytest.mark.parametrize("memo", [True, False])
def test_stale_value_info_is_bad_input(tmp_path, memo):
    d = copy_example("attn_tp2", tmp_path)
    permute_rank0_heads(d, stale=True)
    with pytest.raises(InputError) as err:
        verify_dir(d, memo=memo)
    text = str(err.value)
    assert "rank0.onnx" in text and "self_attn/Reshape_q_output_0" in text
    assert "[2, 6, 4, 4]" in text and "[2, 4, 6, 4]" in text


def test_the_same_change_without_the_annotation_is_refuted(tmp_path):
    d = copy_example("attn_tp2", tmp_path)
    permute_rank0_heads(d, stale=False)
    report = verify_dir(d)
    assert report.verdict == "refuted"
    assert report.failure is not None and report.failure.node.startswith("self_attn/Reshape")


def test_stale_graph_output_shape_is_bad_input(tmp_path):
    d = copy_example("mlp_tp2", tmp_path)

    def change(model: onnx.ModelProto) -> None:
        dims = model.graph.output[0].type.tensor_type.shape.dim
        dims[0].dim_value += 1

    edit(d / "seq.onnx", change)
    with pytest.raises(InputError, match=r"seq\.onnx: tensor 'y' is declared with shape"):
        verify_dir(d)


def test_stale_annotation_gives_one_line_and_exit_2(tmp_path):
    d = copy_example("attn_tp2", tmp_path)
    permute_rank0_heads(d, stale=True)
    result = invoke("verify", d)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "rank0.onnx" in lines[0] and "declared with shape" in lines[0]


def test_annotations_that_agree_are_accepted(tmp_path):
    d = copy_example("attn_tp2", tmp_path)
    for f in ["seq.onnx", "rank0.onnx", "rank1.onnx"]:
        edit(d / f, annotate)
    assert verify_dir(d).verdict == "verified"


def test_stale_layer_function_value_info_is_bad_input(tmp_path):
    """A layer function's value_info (its signature's types) is a declaration like any other."""
    from test_lemmas_layers import layered

    d = layered.write(tmp_path / "m", 2, 2)

    def change(model: onnx.ModelProto) -> None:
        fn = model.functions[0]  # declare its first node's output with a shape it cannot have
        first = fn.node[0].output[0]
        fn.value_info.append(helper.make_tensor_value_info(first, onnx.TensorProto.FLOAT, [1, 2, 3, 4, 5]))

    edit(d / "rank1.onnx", change)
    for memo in (True, False):
        with pytest.raises(InputError, match=r"rank1\.onnx: tensor .* is declared with shape \[1, 2, 3, 4, 5\]"):
            verify_dir(d, memo=memo)


# --- 4. ill-typed programs -------------------------------------------------------------------


def test_incompatible_matmul_is_bad_input_naming_the_node(tmp_path):
    d = copy_example("mlp_tp2", tmp_path)
    # [2, 4, 32] @ [16, 32]
    edit(d / "rank1.onnx", lambda m: node(m, "mlp.down_proj/MatMul").input.__setitem__(1, "mlp.up_proj.weight"))
    with pytest.raises(InputError) as err:
        verify_dir(d)
    assert "rank1.onnx" in str(err.value) and "mlp.down_proj/MatMul" in str(err.value)
    assert "ill-typed" in str(err.value)


def test_element_type_clash_is_bad_input(tmp_path):
    d = copy_example("mlp_tp2", tmp_path)

    def change(model: onnx.ModelProto) -> None:
        relu = node(model, "mlp.act_fn/Relu")
        relu.op_type = "Cast"
        relu.attribute.append(helper.make_attribute("to", onnx.TensorProto.INT64))

    edit(d / "seq.onnx", change)
    with pytest.raises(InputError, match=r"seq\.onnx: ill-typed: node 'mlp\.down_proj/MatMul'"):
        verify_dir(d)


# --- 2. undeclared outputs: every rank takes part --------------------------------------------


def drop_rank0_bias(model_dir: Path) -> None:
    """rank0 forgets its bias: y is the all-reduced sum without it (garbage on rank 0 only)."""

    def change(model: onnx.ModelProto) -> None:
        add = node(model, "mlp.down_proj/Add")
        add.op_type = "Identity"
        del add.input[1:]

    edit(model_dir / "rank0.onnx", change)


def test_undeclared_output_needs_every_rank(tmp_path):
    d = copy_example("mlp_tp2", tmp_path)
    cfg = config(d)
    del cfg["outputs"]
    write_config(d, cfg)
    drop_rank0_bias(d)
    report = verify_dir(d)
    assert report.verdict == "refuted"
    assert not report.outputs[0].ok
    assert "r0:y" in report.failure.reason and "every rank" in report.failure.reason
    assert "mlp.down_proj/Add" in report.failure.reason  # the rank node that computes it
    tried = [report.numeric.output.best, *report.numeric.output.runners_up]
    assert any("replica on every rank" in c.candidate for c in tried)
    assert not any(c.candidate in ("r1:y", "r0:y") for c in tried)  # never one rank alone


def test_undeclared_output_correct_twin_names_every_rank(tmp_path):
    d = copy_example("mlp_tp8", tmp_path)
    cfg = config(d)
    del cfg["outputs"]
    write_config(d, cfg)
    report = verify_dir(d)
    assert report.verdict == "verified"
    assert report.outputs[0].reconstruction == "y = r0:y (replicated on r0..r7)"


def test_seq_output_that_no_rank_has_is_bad_input(tmp_path):
    d = copy_example("mlp_tp2", tmp_path)
    cfg = config(d)
    del cfg["outputs"]
    write_config(d, cfg)
    for f in ["rank0.onnx", "rank1.onnx"]:
        edit(d / f, lambda m: (node(m, "mlp.down_proj/Add").output.__setitem__(0, "z"),
                               m.graph.output[0].__setattr__("name", "z")))
    with pytest.raises(InputError, match=r"seq\.onnx: output 'y' is an output of no rank program"):
        verify_dir(d)


# --- 3. the counterexample search honours declared layouts -----------------------------------


def drop_final_allreduce(model_dir: Path) -> None:
    """Each rank returns its partial (bias / TP included): the sum of the outputs is y."""
    for r in range(2):
        def change(model: onnx.ModelProto) -> None:
            reduce = node(model, "mlp.down_proj/AllReduce")
            reduce.op_type, reduce.domain = "Identity", ""
            del reduce.attribute[:]

        edit(model_dir / f"rank{r}.onnx", change)


def test_declared_rep_output_is_refuted_when_only_a_sum_rebuilds_it(tmp_path):
    d = copy_example("mlp_bias_div_tp", tmp_path)
    drop_final_allreduce(d)
    report = verify_dir(d)
    assert report.verdict == "refuted"
    assert report.numeric.status == "counterexample"
    assert "as declared" in report.numeric.output.best.candidate or "replica" in report.numeric.output.best.candidate


def test_undeclared_output_rebuilt_as_a_sum_still_agrees(tmp_path):
    """Without a declared layout the sum of all ranks' partials is a reconstruction."""
    d = copy_example("mlp_bias_div_tp", tmp_path)
    drop_final_allreduce(d)
    cfg = config(d)
    del cfg["outputs"]
    write_config(d, cfg)
    report = verify_dir(d)
    assert report.verdict == "verified"
    assert report.outputs[0].reconstruction.startswith("y = sum(")


def test_a_model_too_large_to_simulate_gets_no_numeric_search(monkeypatch):
    """A `--meta` export of a large model declares weights it would take gigabytes to draw: the
    counterexample search says so and does not run (the verdict stays unproven, never refuted
    by a guess, and the process is not killed for memory)."""
    from refine.diagnose import counterexample

    assert verify_dir(EXAMPLES / "mlp_missing_allreduce").verdict == "refuted"
    monkeypatch.setattr(counterexample, "SIMULATE_LIMIT", 10)
    report = verify_dir(EXAMPLES / "mlp_missing_allreduce")
    assert report.verdict == "unproven"
    assert report.numeric.status == "not_run" and "elements" in report.numeric.summary
