"""transformer_ext: an encoder-decoder Transformer on fused C++/CUDA ops, exportable to ONNX and TensorRT."""

__version__ = "0.1.0"
