"""The selections' fused Triton kernels: attention over a ``KeySelection`` (``keys``), over
token-gated blocks and NSA's compressed keys (``blocks``), over blocks per query block (``tiles``),
and the lightning indexer's choice and sparse KL (``index``).

Each module imports ``triton`` and is imported only where its kernels run (``gtx.selection.kernels``
decides, by ``GTX_KERNELS`` and the device); ``gtx.selection`` holds the definitions they compute,
the torch and C paths, and the record of which kernel ran. Nothing is imported here: importing this
package imports no Triton.
"""
