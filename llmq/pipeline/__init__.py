"""The stages: quantize, quantize-kv, build, and the recipe runner that chains them."""
