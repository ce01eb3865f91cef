"""The model parts built on ``gtx.attention``: the engine's ``update_graph`` (``engine``), the
interface the runner expects of a model and the layers model plugins share (``layers``), adaptive
computation time (``act``), the one-stage models' stack (``stack``) and decoding (``decode``)."""
