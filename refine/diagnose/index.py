"""The facts a report reads, indexed once (the diagnosis and its plain words both read them)."""

from __future__ import annotations

from collections import defaultdict

from refine.lowering.facts import FactSet
from refine.report.schema import Location


class FactIndex:
    """The facts the report needs, indexed."""

    def __init__(self, facts: FactSet) -> None:
        rows = facts.rows
        self.world_size = rows["world_size"][0][0] if rows["world_size"] else 0
        self.mesh = [(str(dim), int(size)) for dim, _i, size in sorted(rows["mesh_dim"], key=lambda row: row[1])]
        self.rank_of_graph = {g: r for g, kind, r in rows["graph"] if kind == "rank"}
        self.op = {n: op for _, n, op in rows["node"]}
        self.topo = {n: i for g, n, i in rows["topo"] if g == "seq"}
        self.topo_all = {n: i for _g, n, i in rows["topo"]}
        self.loc = {n: Location(module=m, file=f, line=ln) for _, n, m, f, ln in rows["loc"]}
        self.inputs: dict[str, list[str]] = defaultdict(list)
        self.in_slot: dict[str, dict[int, str]] = defaultdict(dict)
        self.out_slot: dict[str, dict[int, str]] = defaultdict(dict)
        self.consumers: dict[str, list[str]] = defaultdict(list)
        for g, n, i, t in rows["node_in"]:
            self.inputs[n].append(t)
            self.in_slot[n][i] = t
            self.consumers[t].append(n)
        for _g, n, i, t in rows["node_out"]:
            self.out_slot[n][i] = t
        self.producer = {t: n for _g, n, _i, t in rows["node_out"]}
        self.node_graph = {n: g for g, n, _op in rows["node"]}
        self.seq_outputs = [(t, name) for g, t, name in rows["graph_output"] if g == "seq"]
        self.seq_inputs = {t for g, t, _ in rows["graph_input"] if g == "seq"}
        self.rank_outputs = {t for g, t, _ in rows["graph_output"] if g != "seq"}
        self.graph_inputs = {t for _g, t, _ in rows["graph_input"]}
        self.graph_outputs = {t for _g, t, _ in rows["graph_output"]}
        self.tensor_graph: dict[str, str] = {t: g for g, t, _ in rows["ndim"]}
        self.dims = {(t, a): d for g, t, a, d in rows["dim"]}
        self.ndim = {t: r for _g, t, r in rows["ndim"]}
        self.consts = {t for _g, t, _h in rows["const"]}
        self.const_num = {t: (int(n), int(d)) for _g, t, n, d in rows["const_num"]}  # scalar constants, exactly
        self.slices = {(n, out): (axis, start, end) for _g, n, out, axis, start, end in rows["slice_spec"]}
        self.sig = {n: s for _g, n, s in rows["sig"]}
        # collectives: node -> (kind, group id, call number); (group, call) -> {graph: node}
        self.coll = {n: (kind, grp, seq) for _g, n, kind, grp, seq in rows["coll"]}
        self.calls: dict[tuple[str, int], dict[str, str]] = defaultdict(dict)
        for g, n, _kind, grp, seq in rows["coll"]:
            self.calls[(grp, seq)][g] = n
        members: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for grp, index, rank in rows["group_member"]:
            members[grp].append((index, rank))
        self.group_members = {grp: [r for _i, r in sorted(m)] for grp, m in members.items()}
