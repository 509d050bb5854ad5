"""`python -m refine.cli`: the command line."""

from refine.cli.main import app

app()
