"""DeepSeek V4.1 packing, packed DSpark target and draft, and context-parallel capture."""
