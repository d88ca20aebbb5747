"""The on-disk records of invariant 9: the files a lost or damaged index is rebuilt from.

Every committed manifest (and what its entry needs to be restored) also
exists as an immutable, checksummed, versioned record file under
``records/``.  :mod:`.format` is the one record codec (the remote tier
ships the same payloads), :mod:`.files` names and writes the files,
:mod:`.sync` keeps them in step with the index, :mod:`.obsolete` retires
the records of dropped rows, :mod:`.restore` and :mod:`.rebuild` bring an
index back from them.
"""

__all__: list[str] = []  # a layer of the store: its public names are re-exported by adstore.store
