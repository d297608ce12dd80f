"""The draft network: its configuration, the Llama-style EAGLE-3 layer, its attention and the MLA head."""
