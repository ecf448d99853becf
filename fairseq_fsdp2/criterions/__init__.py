"""fairseq criteria shipped with the plugin.

``chunked.py`` registers ``label_smoothed_cross_entropy_chunked`` and ``cross_entropy_chunked``:
fairseq's criteria with the output projection, log-softmax and loss computed over chunks of
target tokens (``--loss-chunk-tokens``), so that the tokens x vocabulary logits never exist at
once; ``fused.py`` computes them and their gradients in one chunked pass.
"""
