"""Absolute paths inside a vLLM tree's files: named after their roots on capture, made this host's on restore.

vLLM's AOT artifact (``rank_<i>_<j>/model``) and Inductor's AOTAutograd
entries beside it are pickles that name the venv (``co_filename`` of the
bytecode Dynamo wrote, ``File "…/vllm/model_executor/models/llama.py"`` in
the graph's stack traces, ``# File:`` comments of Inductor's wrapper) and the
cache root (the repro script Inductor keeps beside a graph).  A host whose
``VLLM_CACHE_ROOT`` or venv sits elsewhere cannot use those bytes as they are:
the names point at the first host.  ccache's ``base_dir`` answers the same
problem for compilers, and :mod:`adstore.integration.validity.roots` for
Inductor's kernel names; this module does it for pickled strings:

* :func:`to_names` re-emits a pickle with every string that starts a path
  under a root written with the root's name (``${cache_root}/…``, by
  :func:`~adstore.integration.validity.roots.relative`), nested pickles
  (``bytes`` holding one, as torch nests AOTAutograd's entry) included;
* :func:`to_paths` does the reverse with this host's roots.

A pickle is rewritten op by op (:mod:`pickletools`), never unpickled: a
string op is emitted again with its new length, ``FRAME`` ops are dropped
(frames are optional; the unpickler reads a stream without them), every
other op is copied byte for byte.  What cannot be rewritten this way (a root
inside opaque bytes, a protocol-0 string, a file that is not one whole
pickle, a name already spelled ``${root}``) leaves the file as it is: the
caller keeps the refusal that names the path.

One more kind is left as it is, and is no reason to refuse: a shared
object (ELF) whose roots occur only where the dynamic loader never looks.
Inductor's kernels record their source's and headers' paths as debug
information and as ``__FILE__`` text of torch's check messages; the loader
reads paths only from ``.interp`` and ``.dynamic``/``.dynstr`` (an
interpreter, ``NEEDED``, ``RPATH``, ``RUNPATH``).  :func:`loader_neutral`
says which: a root there, or outside every section, keeps the refusal.
(Inductor's own entries place such kernels under any install path already:
:mod:`~adstore.integration.validity.roots`.)
"""

from __future__ import annotations

import pickletools
import re
import struct
from collections.abc import Callable, Mapping, Sequence

from adstore.integration.validity import roots

__all__ = ["loader_neutral", "placeholders", "to_names", "to_paths"]

#: Nested pickles deeper than this are left as they are (and so keep their refusal).
_MAX_NESTING = 8
_STRING_OPS = frozenset({"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"})
_BYTES_OPS = frozenset({"SHORT_BINBYTES", "BINBYTES", "BINBYTES8"})
_SHT_DYNAMIC = 6
#: The sections the dynamic loader reads paths from.
_LOADER_SECTIONS = frozenset({b".interp", b".dynamic", b".dynstr"})

Rewrite = Callable[[str], str]


def placeholders(names: Sequence[str]) -> dict[str, bytes]:
    """Each root name's placeholder as bytes: ``${name}`` (what :func:`roots.relative` writes)."""
    return {name: ("${" + name + "}").encode() for name in names}


def to_names(data: bytes, anchors: Mapping[str, str]) -> bytes | None:
    """``data`` (a whole pickle) with every root of ``anchors`` (name -> path) named; None when it cannot be.

    None: not one whole pickle, a placeholder already in it, or a root left
    somewhere a string op does not hold it (opaque bytes, a protocol-0 op).
    """
    table = roots.normalized(list(anchors.items()))
    if not table or any(p in data for p in placeholders([n for n, _ in table]).values()):
        return None
    rewritten = _pickle(data, lambda s: roots.relative(s, table), 0)
    if rewritten is None or any(path.encode() in rewritten for _, path in table):
        return None
    return rewritten


def to_paths(data: bytes, anchors: Mapping[str, str], used: Sequence[str]) -> bytes | None:
    """``data`` (a pickle :func:`to_names` wrote, naming roots ``used``) with this host's paths, or None."""
    if any(name not in anchors for name in used):
        return None
    table = {name: anchors[name] for name in used}
    pattern = re.compile(r"\$\{(" + "|".join(re.escape(n) for n in sorted(table)) + r")\}") if table else None
    if pattern is None:
        return data
    rewritten = _pickle(data, lambda s: pattern.sub(lambda m: table[m.group(1)], s), 0)
    if rewritten is None or any(p in rewritten for p in placeholders(list(table)).values()):
        return None
    return rewritten


def _pickle(data: bytes, rewrite: Rewrite, depth: int) -> bytes | None:
    """The pickle ``data`` with ``rewrite`` applied to each string (nested pickles too); None if not one pickle."""
    if depth > _MAX_NESTING or not data.startswith(b"\x80"):
        return None
    try:
        ops = list(pickletools.genops(data))
    except Exception:  # noqa: BLE001 - not a pickle pickletools can walk: left as it is
        return None
    if not ops or ops[-1][0].name != "STOP" or ops[-1][2] != len(data) - 1:
        return None  # trailing bytes, or more than one pickle
    out: list[bytes] = []
    changed = False
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        assert pos is not None and end is not None
        if op.name == "FRAME":
            changed = True
            continue
        raw = data[pos:end]
        if op.name in _STRING_OPS and isinstance(arg, str):
            new = rewrite(arg)
            if new != arg:
                raw = _string_op(new)
        elif op.name in _BYTES_OPS and isinstance(arg, bytes) and arg.startswith(b"\x80"):
            inner = _pickle(arg, rewrite, depth + 1)
            if inner is not None and inner != arg:
                raw = _bytes_op(inner)
        changed = changed or raw != data[pos:end]
        out.append(raw)
    return b"".join(out) if changed else data


def _string_op(text: str) -> bytes:
    body = text.encode("utf-8", "surrogatepass")
    if len(body) < 256:
        return b"\x8c" + struct.pack("<B", len(body)) + body
    if len(body) < 1 << 32:
        return b"X" + struct.pack("<I", len(body)) + body
    return b"\x8d" + struct.pack("<Q", len(body)) + body


def _bytes_op(body: bytes) -> bytes:
    if len(body) < 256:
        return b"C" + struct.pack("<B", len(body)) + body
    if len(body) < 1 << 32:
        return b"B" + struct.pack("<I", len(body)) + body
    return b"\x8e" + struct.pack("<Q", len(body)) + body


def loader_neutral(data: bytes, needles: Sequence[bytes]) -> bool:
    """Whether ``data`` is a 64-bit little-endian ELF file whose ``needles`` all lie in sections the loader ignores.

    False for anything else: another format, a needle in ``.interp``,
    ``.dynamic`` or ``.dynstr``, or outside every section (headers, padding).
    """
    if data[:6] != b"\x7fELF\x02\x01" or len(data) < 64:
        return False
    try:
        (shoff,) = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
        names_at = headers[shstrndx][4]
        sections: list[tuple[int, int, bool]] = []  # (start, end, read by the loader)
        for name_off, sh_type, _, _, offset, size in headers:
            name = data[names_at + name_off : data.index(b"\x00", names_at + name_off)]
            loader = sh_type == _SHT_DYNAMIC or name in _LOADER_SECTIONS
            sections.append((offset, offset + size, loader))
    except (struct.error, IndexError, ValueError):
        return False
    for needle in needles:
        for m in re.finditer(re.escape(needle), data):
            inside = [loader for start, end, loader in sections if start <= m.start() and m.end() <= end]
            if not inside or any(inside):
                return False
    return True
