"""The CPU demo: a tiny V4.1 target that answers small tasks exactly, its tokenizer and its data.

``demo_target`` (the shipped target), ``tiny_tasks`` (the tasks, with the held-out split) and
``tiny_assets`` (the target folder, tokenizer and train/validation files ``make distill`` trains on).
"""
