"""The command line (typer): `refine export / lower / run / verify / batch / zoo / rules`.

- `main`: the app and its commands, thin wrappers over refine.pipeline, refine.batch and the
  exporters; `rules`: the `refine rules` sub-commands; `common`: what both need.

May import: anything (it is the top).
"""
