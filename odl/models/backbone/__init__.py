"""EasyRec's backbone: a DAG of blocks over the feature groups (``model_class: "RankModel"``).

:mod:`odl.models.rank_model` registers the model; this package holds its parts:
:mod:`.value_specs` (the shapes of what flows between blocks), :mod:`.block_registry` (the
layers a block names by ``class_name``), the layer modules that register there, the lambda
subset (:mod:`.input_functions`), the input layers of the feature groups and the graph.
"""
