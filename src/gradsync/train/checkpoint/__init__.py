"""What a run keeps on disk to be continued, the directory that holds it, and what comes out of it.

``format.py`` is the checkpoint file: written atomically, every byte verified before it
is used; ``unit.py`` the unit it belongs to (``checkpoint.pt`` and its shard directory,
of one run and one step); ``state.py`` what a save holds and a load restores, and the
decision to start fresh, continue or say the run is finished; ``kept.py`` the units kept
beside the newest (``--keep-last``, ``--keep-best``) and the one ``--resume-from`` installs;
``identity.py`` what of a run a continuation may not change silently (``--override``);
``guard.py`` the run directory checked (writable, free space) and locked; ``size.py`` the
bytes a save writes, for that free-space check; ``restarts.py`` a restart after a
failure, recorded and said; ``export.py`` and ``export_weights.py`` the trained model out
of a checkpoint (``gradsync export``).
"""
