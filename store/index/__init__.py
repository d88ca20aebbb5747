"""The LMDB index layer: the index file's checks, the environment, typed tables and their rows.

Everything the store keeps in LMDB goes through here: :mod:`.file` checks
the data file before LMDB maps it (a damaged file must not fault a read),
:mod:`.env` opens the environment with its hygiene (fork, map size, stale
readers), :mod:`.tables` is the one module that names a database (typed
transactions), :mod:`.rows` encodes their rows, :mod:`.shadows` keeps the
binary shadows of entry rows, :mod:`.migrations` upgrades an older schema.
This layer imports nothing of the records, the maintenance passes or the
remote tier above it.
"""

__all__: list[str] = []  # a layer of the store: its public names are re-exported by adstore.store
