"""vLLM's own compile artifacts in adstore: directory trees as store entries, and the hooks that move them.

``trees`` stores a directory vLLM wrote as one entry and puts it back whole
(or not at all); ``hooks`` wraps the vLLM functions that look for and write
those directories.  Nothing here imports vLLM until ``hooks.install()`` runs.
"""

__all__: list[str] = []
