"""Pictures: pattern, results and trained-model figures (``plot``, ``plot_model``) and the HTML
report (``report``)."""
