"""refine/run/window_seeds.py: a chunk need of one layer is seeded for the same tensor of every
other layer of its stack, so that a stack's reduce-scatters meet their chunks in one more solve
instead of one per layer; only tensors that exist are named, and a need that names no layer, or
two different layers, predicts nothing."""

from __future__ import annotations

from refine.lowering.facts import quoted as clingo_string
from refine.run.window_seeds import analogues, window_seeds

GRAD = "seq:model.layers.{k}.self_attn (backward)/MatMul (view)"
OTHER = "seq:model.layers.{k}.mlp (backward)/MatMul"
TENSORS = frozenset(clingo_string(name.format(k=k)) for name in (GRAD, OTHER) for k in range(3)) | {
    clingo_string("seq:lm_head/MatMul"), clingo_string("seq:model.layers.7.self_attn (backward)/Other")}


def test_a_layer_need_names_every_other_layer_where_the_tensor_exists() -> None:
    need = (clingo_string(GRAD.format(k=1)), "2", "2")
    assert analogues(need, TENSORS) == [(clingo_string(GRAD.format(k=k)), "2", "2") for k in (0, 2)]


def test_a_window_of_a_window_is_renamed_inside_its_term() -> None:
    need = (f"win({clingo_string(GRAD.format(k=2))},0,0,2)", "2", "2")
    assert analogues(need, TENSORS) == [(f"win({clingo_string(GRAD.format(k=k))},0,0,2)", "2", "2") for k in (0, 1)]


def test_no_layer_index_or_two_layers_predict_nothing() -> None:
    assert analogues((clingo_string("seq:lm_head/MatMul"), "0", "4"), TENSORS) == []
    two = (f"pair({clingo_string(GRAD.format(k=0))},{clingo_string(OTHER.format(k=1))})", "0", "2")
    assert analogues(two, TENSORS) == []


def test_seeds_are_new_ones_only_with_their_analogues() -> None:
    seeded: set = set()
    need = (clingo_string(GRAD.format(k=2)), "2", "2")
    first = window_seeds([need], seeded, TENSORS)
    assert first == [f"window_seed({clingo_string(GRAD.format(k=k))},2,2)." for k in (2, 0, 1)]
    assert window_seeds([(clingo_string(GRAD.format(k=0)), "2", "2")], seeded, TENSORS) == []


def test_quotes_in_a_name_are_escaped_as_clingo_writes_them() -> None:
    assert clingo_string('seq:a"b\\c') == '"seq:a\\"b\\\\c"'
