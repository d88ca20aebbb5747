"""Inductor's vector-ISA probes answered from an entry (the compile stage's scope), only with well-formed answers."""

from __future__ import annotations

import hashlib

from torch._inductor import cpu_vec_isa

from adstore.integration.placement.probes import PROBES

CODE = "this is not C++: a probe that ran would fail to build"


def key(isa: cpu_vec_isa.VecISA, code: str) -> str:
    return hashlib.sha256(f"{isa}\0{isa.build_arch_flags()}\0{code}".encode()).hexdigest()


def test_a_recorded_answer_is_given_back_without_building_and_the_original_is_restored():
    isa = cpu_vec_isa.VecAVX2()
    original = cpu_vec_isa.VecISA.check_build
    with PROBES.scope({key(isa, CODE): True}) as seen:
        assert isa.check_build(CODE) is True  # answered: the source above would not compile
    assert seen == {key(isa, CODE): True}
    assert cpu_vec_isa.VecISA.check_build is original
    assert isa.check_build(CODE) is False  # outside the block the probe runs (and fails to build)


def test_malformed_answers_are_ignored_and_the_probe_runs():
    isa = cpu_vec_isa.VecAVX2()
    good = key(isa, CODE)
    hostile = {good.upper(): True, "../" + good: True, good: "yes"}  # not a hex key, not a bool
    with PROBES.scope(hostile) as seen:
        assert isa.check_build(CODE) is False
    assert seen == {key(isa, CODE): False}
