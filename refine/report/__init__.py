"""Report: the result of a verification as data, and its renderings.

- `schema`: the pydantic models of a report (docs/report.schema.json) and their JSON files.
- `render`: text, HTML and JUnit renderings, and the wording helpers they share (groups,
  ranks, layouts in words).
- `progress`: the live progress display of a long run.

May import: refine's base modules only (the diagnosis fills the schema; nothing here reads facts).
"""
