"""Building blocks of the runtime's models: linear layers (dense and quantized), paged attention, RoPE, RMSNorm."""
