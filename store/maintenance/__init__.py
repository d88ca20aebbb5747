"""The maintenance passes: the budget, eviction, the orphan sweep and verify.

Each destructive pass is a frozen plan first (what goes, the bytes it
frees) and an ``execute()`` that re-checks under the write lock:
:mod:`.eviction` (LRU by entry, or removal by name), :mod:`.sweep`
(leftovers of killed writers past the grace period), :mod:`.verify` (every
invariant, ``--fix`` repairs), :mod:`.budget` (the persisted budget) and
:mod:`.inline` (the bounded eviction a writer runs without a daemon).
"""

__all__: list[str] = []  # a layer of the store: its public names are re-exported by adstore.store
