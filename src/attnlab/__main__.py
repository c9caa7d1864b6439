"""``python -m attnlab``: the command-line interface, for trees run without installing."""

from .cli import app

app(prog_name="attnlab")
