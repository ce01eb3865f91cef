"""The token graph and the pattern language: batched token graphs and their edge sets (``tokens``),
the pattern type and its composition (``pattern``), pattern specs such as ``local:w=4|strided:l=8``
(``spec``). Edges run ``src -> dst``: query ``dst`` attends to key ``src``."""

from gtx.graph.tokens import EdgeSet, TokenGraph, build_graph, positions, possible_edges

__all__ = ["EdgeSet", "TokenGraph", "build_graph", "positions", "possible_edges"]
