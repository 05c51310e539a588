"""The torch backend: the decode loop, the lean forward and its fused CPU kernels, the KV cache, adapter strategies and sampling."""
