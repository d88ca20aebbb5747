"""The remote tier's modules import one way: no cycle, not even through an import made only for type checking.

import-linter's contracts leave type-checking imports out; a cycle through
one is still two modules that each need the other, and becomes an import
error the day the import is needed at run time.
"""

from __future__ import annotations

import grimp


def test_the_remote_tier_has_no_import_cycle():
    graph = grimp.build_graph("adstore.store", exclude_type_checking_imports=False)
    remote = {m for m in graph.modules if m.startswith("adstore.store.remote.")}
    cycles = [
        (module, imported)
        for module in sorted(remote)
        for imported in sorted(graph.find_modules_directly_imported_by(module) & remote)
        if graph.find_shortest_chain(importer=imported, imported=module) is not None
    ]
    assert cycles == []
