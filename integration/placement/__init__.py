"""Files that become code: one rule for where they are placed, what is captured, and who may have written them.

Every integration that stores or loads code (the engine cache, the compile
stage, the Inductor integration, vLLM trees) goes through this package:

* ``rule``: the trust rule (trusted uids, a file's writer, a directory's
  safety, inline blobs), always judged on ``fstat`` of the descriptor the
  bytes are read from;
* ``dirs``: directories reached by descriptor, judged on the way, tightened
  when they are this user's (umask 002); the process's private code directory;
* ``place``: blobs out of the store into such directories, verified;
* ``capture``: files into the store under the same rule;
* ``probes``: Inductor's ISA probes answered from the store.

(docs/architecture.md, "Files that become code".)  Importing this package
imports no torch.
"""

from adstore.store import lazy_exports

_EXPORTS = {
    "placement.rule": ("Writer", "blob_refusal", "dir_refusal", "group_private", "trusted_uids"),
    "placement.dirs": ("checked_dir", "open_dir", "private_dir", "private_path", "temp_name"),
    "placement.place": ("copy_code", "judge", "place", "read_trusted"),
    "placement.capture": ("Captured", "capture_files"),
    "placement.probes": ("PROBES", "Probes", "forget", "valid_answers"),
}

__all__ = sorted(name for names in _EXPORTS.values() for name in names)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, base="adstore.integration")
