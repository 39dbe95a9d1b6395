"""Modules the workers' forkserver imports around its preload (see ``gradsync.launch``).

The forkserver runs in the caller's process group, so Ctrl-C in a terminal
reaches it too. Python's forkserver ignores SIGINT only *after* it has imported
its preload modules (torch: seconds), so a Ctrl-C during those seconds printed a
KeyboardInterrupt traceback from deep inside torch's import, beside the
launcher's own one-line "interrupted". The launcher starts it with SIGINT
blocked; :mod:`.exit_on_sigint` is imported first (a quiet exit, then unblocked)
and :mod:`.restore_sigint` last, so a SIGINT while starting or preloading ends the
forkserver without a traceback and workers react to Ctrl-C exactly as before.
"""
