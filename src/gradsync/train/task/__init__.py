"""What a run trains: the model, its data, the loss and what an item is, the optimizer and schedule.

``build.py`` turns ``--model``/``--data`` (a built-in name or the user's factory) into one
:class:`~gradsync.train.task.build.Task`, and holds the data contract users write to,
:class:`~gradsync.train.task.build.TrainData`; ``conventions.py`` how a sample and a
model's output are read (pairs, transformers' dicts and ``labels``); ``eval_metrics.py``
the held-out metrics' contract; ``init_from.py`` the weights a fresh run starts from
(``--init-from``: an export, safetensors, a transformers directory, a run's checkpoint);
``recompute.py`` activation checkpointing per block (``--activation-checkpointing``);
``loader.py`` the step's micro-batches, collated here or by DataLoader workers
(``--loader-workers``);
``builtins.py`` the built-in datasets and optimizers by
name; ``optim.py`` the parameter groups, the optimizer factory and the strategy built
with it (factories are loaded by ``gradsync/factory.py``, the one loader);
``schedule.py`` the built-in learning-rate schedule and what a continued run does
with it.
"""
