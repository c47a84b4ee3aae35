"""farsight: attention that sees past its window — causal retrieval (GCA/DRT) and lookahead keys (CASTLE)."""

__version__ = "0.1.0"
