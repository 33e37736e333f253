"""The `tokenwing` commands, one module per group; each adds its parsers (`add_parsers`) and imports what its
commands need only when one runs (lazily: importing them all at start-up took 2.4-3.4 s, not 0.25 s).
cli.py is the parser and the dispatch."""
