"""Task data: the task base class and helpers for task authors (``task``), vocabularies and batches
of token graphs (``batch``). A new task is a plugin (``plugins/``) built on ``gtx.data.task.Task``."""
