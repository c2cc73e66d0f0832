"""What a run of the packed V4.1 DSpark recipe is, read by the recipe and by the evaluator alike.

``config`` (the validated ``recipe_args``), ``run_record`` (the effective config and launch folder a
checkpoint keeps), ``data_checks`` (chat files read as upstream's loader reads them) and ``loading``
(the checked target and the packed draft). Nothing here imports ``recipes/`` or ``evaluation/``.
"""
