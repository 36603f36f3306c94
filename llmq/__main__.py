"""`python -m llmq` is `llmq`: for environments where the console script is not on PATH."""

from .cli.main import main

main()
