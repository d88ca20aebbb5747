"""Kernel names relative to the install roots: the same command line under another path is the same name.

Inductor hashes a kernel's source with its compiler command line, whose
``-I``/``-L`` hold torch's and Python's directories.  With
:mod:`adstore.integration.validity.roots` installed, the name comes from the
line with each root named, plus the bytes' identity (torch's build key and
the toolchain).  These tests call torch's own ``codecache.write`` and
``CppBuilder`` (no compile); the moved interpreter itself is
``test_inductor_fleet.py`` (slow).
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from torch._inductor import codecache  # noqa: E402
from torch._inductor.cpp_builder import CppBuilder, CppTorchDeviceOptions  # noqa: E402

from adstore.integration.validity import roots  # noqa: E402

HERE_ROOTS = roots.normalized([("torch", "/opt/venv/lib/site-packages/torch"), ("prefix", "/opt/venv")])
THERE_ROOTS = roots.normalized([("torch", "/home/me/env/lib/site-packages/torch"), ("prefix", "/home/me/env")])


def test_a_root_is_named_only_where_a_whole_path_starts_with_it():
    text = "-I/opt/venv/include -L/opt/venv /opt/venv2/x '/opt/venv/lib/site-packages/torch/include' x/opt/venv/y"
    assert roots.relative(text, HERE_ROOTS) == (
        "-I${prefix}/include -L${prefix} /opt/venv2/x '${torch}/include' x/opt/venv/y"
    )


def test_the_same_line_under_two_prefixes_is_the_same_text():
    here = "g++ i -I/opt/venv/lib/site-packages/torch/include -L/opt/venv/lib -o o.so"
    there = here.replace("/opt/venv", "/home/me/env")
    assert roots.relative(here, HERE_ROOTS) == roots.relative(there, THERE_ROOTS)


def test_roots_are_absolute_each_once_longest_first():
    got = roots.normalized([("a", "/x"), ("b", "/x/y/"), ("c", "/x"), ("d", "rel"), ("e", "/"), ("f", "")])
    assert got == (("b", "/x/y"), ("a", "/x"))


def _kernel_line() -> str:
    option = CppTorchDeviceOptions(**codecache.CppCodeCache.cpp_compile_command_flags, device_type="cpu")
    return CppBuilder(name="o", sources="i", BuildOption=option).get_command_line()


@pytest.fixture
def moved(monkeypatch):
    """This host's roots, and the same roots under ``/elsewhere``: returns a function that switches to one of them."""
    real = roots.host_roots()
    elsewhere = tuple((name, "/elsewhere" + path) for name, path in real)

    def use(table):
        monkeypatch.setattr(roots, "host_roots", lambda: table)

    yield real, elsewhere, use


def test_inductor_names_a_kernel_alike_under_another_install_path(moved, tmp_path):
    real, elsewhere, use = moved
    line = _kernel_line()
    torch_dir = dict(real)["torch"]
    assert torch_dir in line  # the line holds the path: the name would too
    moved_line = re.sub(r"(?<=-[IL])/", "/elsewhere/", line)  # every path of the line is an -I or -L
    assert moved_line != line and "/elsewhere" + torch_dir in moved_line
    assert roots.install()
    try:
        key_here, _ = codecache.write("int k;", "main.cpp", extra=line, specified_dir=str(tmp_path))
        use(elsewhere)
        key_there, _ = codecache.write("int k;", "main.cpp", extra=moved_line, specified_dir=str(tmp_path))
        assert key_here == key_there
        # bytes decide: another torch build or toolchain is another name
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(roots, "bytes_identity", lambda: "another torch")
            key_other, _ = codecache.write("int k;", "main.cpp", extra=moved_line, specified_dir=str(tmp_path))
        assert key_other != key_there
        # nothing but the kernels' two writes is renamed
        py_key, _ = codecache.write("x = 1", "py", extra=line, specified_dir=str(tmp_path))
    finally:
        roots.uninstall()
    assert not roots.active()
    assert codecache.write("x = 1", "py", extra=line, specified_dir=str(tmp_path))[0] == py_key
    plain, _ = codecache.write("int k;", "main.cpp", extra=line, specified_dir=str(tmp_path))
    assert plain != key_here  # without adstore: Inductor's own name, paths and all


def test_install_is_counted_and_the_last_uninstall_puts_write_back():
    original = codecache.write
    with roots.relocated() as took:
        assert took and roots.active() and codecache.write is not original
        with roots.relocated():
            pass
        assert roots.active()  # the outer user still has it
    assert not roots.active() and codecache.write is original
