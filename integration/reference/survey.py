"""Which ``transformers`` causal-LM model types the reference pipeline handles, checked by running it.

``python -m adstore.integration.reference.survey [TYPE ...] [--write]`` runs
:func:`check` for every model type in transformers' causal-LM mapping (or the
named ones), each in its own interpreter with a time limit, so that one
architecture's crash or hang is that architecture's verdict.  ``--write``
regenerates :mod:`~adstore.integration.reference.survey_results`, which the
model factory reads to accept or refuse a model type by name.

A model type is *handled* when all of this holds for its small config
(:func:`~adstore.integration.reference.model_types.small_config`), with random
weights from a safetensors checkpoint:

* the pipeline runs cold (miss, save) and warm (hit) against a store, and the
  warm output equals the cold one bit for bit;
* both are within 1e-4 of eager ``transformers`` (which must be finite);
* the same holds with ``compile`` on ``torch_compile``.

Otherwise the verdict is the first step that failed and why.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = ["REWRITES", "check", "main", "model_types"]

#: The pattern rewrites whose match counts a verdict records, in pipeline order.
REWRITES = ("match_rms_norm", "match_swiglu", "match_rope")
_RESULTS = Path(__file__).with_name("survey_results.py")
_TOLERANCE = 1e-4


def model_types() -> list[str]:
    """Every model type with a causal-LM class in the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


class _Refused(Exception):
    def __init__(self, step: str, why: str) -> None:
        super().__init__(f"{step}: {why}")


def _run_twice(
    factory: Any, checkpoint: Any, transforms: dict, inputs: tuple, expected: Any, step: str
) -> dict[str, Any]:
    """Cold then warm through one store; returns the cold run's info."""
    import torch

    from adstore.integration.pipeline.optimizer import InferenceOptimizer

    outs, info = [], {}
    for want in ("miss", "hit"):
        torch._dynamo.reset()
        opt = InferenceOptimizer(factory, checkpoint, transforms)
        module = opt()
        first = opt.events[0]
        if first.kind != want:
            raise _Refused(step, f"{want} expected, got {first.kind} ({first.reason}: {first.detail})")
        if want == "miss" and not any(e.kind == "save" for e in opt.events):
            bypass = next((e for e in opt.events if e.kind == "bypass"), None)
            raise _Refused(step, f"the pipeline cache bypasses it ({getattr(bypass, 'reason', None)})")
        info = info or opt.info
        with torch.no_grad():
            outs.append(module(*inputs))
    for out in outs:
        diff = (out.float() - expected.float()).abs().max().item() if out.shape == expected.shape else None
        if diff is None or not diff <= _TOLERANCE:  # NaN fails too
            raise _Refused(step, f"output differs from eager transformers (max abs diff {diff})")
    if not torch.equal(outs[0], outs[1]):
        raise _Refused(step, "the warm (restored) output is not the cold one bit for bit")
    return info


def check(model_type: str, *, compile: bool = True) -> dict[str, Any]:
    """Run the reference pipeline on ``model_type``; the verdict as a JSON-safe dict."""
    started = time.perf_counter()
    step = "config"
    verdict: dict[str, Any] = {"model_type": model_type, "handled": False}
    try:
        import torch

        from adstore.integration.reference.checkpoint import read_checkpoint, write_random_checkpoint
        from adstore.integration.reference.models import ModelFactory, tiny_config
        from adstore.integration.reference.pipeline import default_transforms

        factory = ModelFactory(config=tiny_config(model_type, surveyed=False))
        step = "build"
        meta = factory.build()
        with tempfile.TemporaryDirectory(prefix="adstore-survey-") as tmp:
            checkpoint = write_random_checkpoint(meta, Path(tmp) / "checkpoint", seed=0)
            step = "eager"
            inputs = factory.example_inputs(batch=2, seq=8)
            with torch.no_grad():
                out = factory.eager_model(read_checkpoint(checkpoint))(*inputs)
            expected = out.logits if hasattr(out, "logits") else out[0]
            if not torch.isfinite(expected).all():
                raise _Refused(step, "eager transformers gives non-finite logits with random weights")
            step = "pipeline"
            info = _run_twice(
                factory, checkpoint, default_transforms(pipeline_cache={"root": f"{tmp}/eager"}), inputs, expected, step
            )
            verdict["matches"] = [info.get(name, {}).get("matches", 0) for name in REWRITES]
            if compile:
                step = "torch_compile"
                _run_twice(
                    factory,
                    checkpoint,
                    default_transforms(
                        pipeline_cache={"root": f"{tmp}/compiled"}, compile={"backend": "torch_compile"}
                    ),
                    inputs,
                    expected,
                    step,
                )
        verdict["handled"] = True
    except _Refused as exc:
        verdict["why"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - any failure is this model type's verdict
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        verdict["why"] = f"{step}: {type(exc).__name__}: {first}"
    verdict["why"] = verdict.get("why", "")[:240]
    verdict["seconds"] = round(time.perf_counter() - started, 1)
    return verdict


def _check_in_child(model_type: str, compile: bool, timeout: float) -> dict[str, Any]:
    """:func:`check` in a fresh interpreter: a crash, a hang or leaked state stays with one type."""
    cmd = [sys.executable, "-m", "adstore.integration.reference.survey", "--one", model_type]
    cmd += [] if compile else ["--no-compile"]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"model_type": model_type, "handled": False, "why": f"no verdict within {timeout:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return {"model_type": model_type, "handled": False, "why": f"the check died (exit {proc.returncode}): {tail}"}


def _table(name: str, value_type: str, rows: dict[str, Any]) -> str:
    """``NAME: dict[str, T] = {...}`` with one line per model type (a data file, read by type)."""
    body = "".join(f"    {k!r}: {rows[k]!r},\n" for k in sorted(rows))
    return f"{name}: dict[str, {value_type}] = {{\n{body}}}"


def _by_release(measured: dict[str, str]) -> str:
    """``MEASURED_WITH``: each transformers release -> the model types whose verdict was measured on it."""
    releases: dict[str, list[str]] = {}
    for model_type in sorted(measured):
        releases.setdefault(measured[model_type], []).append(model_type)
    body = ""
    for release in sorted(releases):
        names = textwrap.fill(" ".join(repr(t) + "," for t in releases[release]), 100, break_on_hyphens=False)
        body += f"    {release!r}: (\n{textwrap.indent(names, ' ' * 8)}\n    ),\n"
    return f"MEASURED_WITH: dict[str, tuple[str, ...]] = {{\n{body}}}"


def _write(verdicts: list[dict[str, Any]]) -> None:
    """Regenerate survey_results.py, merged over the verdicts already there."""
    import torch
    import transformers
    from transformers import AutoConfig

    from adstore.integration.reference import survey_results as old
    from adstore.integration.reference.model_types import recipe
    from adstore.integration.reference.models import ARCHITECTURES

    handled = {k: list(v) for k, v in old.HANDLED.items()}
    refused = dict(old.REFUSED)
    measured = {t: release for release, types in old.MEASURED_WITH.items() for t in types}
    for v in verdicts:
        handled.pop(v["model_type"], None)
        refused.pop(v["model_type"], None)
        measured[v["model_type"]] = transformers.__version__
        if v["handled"]:
            handled[v["model_type"]] = v["matches"]
        else:
            refused[v["model_type"]] = v["why"]
    # A verdict measured under an older release keeps the defaults it was measured with.
    fresh = {v["model_type"] for v in verdicts}
    recipes = {
        t: old.RECIPES[t] if t in old.RECIPES and t not in fresh else recipe(AutoConfig.for_model(t).to_dict())
        for t in sorted(handled)
        if t not in ARCHITECTURES
    }
    text = (
        '"""Generated by ``python -m adstore.integration.reference.survey --write``; do not edit.\n\n'
        "HANDLED maps each model type the reference pipeline runs (cold, warm and with torch_compile,\n"
        "within 1e-4 of eager transformers) to its pattern-rewrite matches for two layers, in the order\n"
        "match_rms_norm, match_swiglu, match_rope.  REFUSED maps every other causal-LM model type to the\n"
        "first step that failed and why.  MEASURED_WITH names the transformers release each verdict was\n"
        'measured on; TRANSFORMERS is the release of the latest survey run.\n"""\n\n'
        '__all__ = ["TRANSFORMERS", "TORCH", "HANDLED", "REFUSED", "MEASURED_WITH", "RECIPES"]\n\n'
        f"TRANSFORMERS = {transformers.__version__!r}\n"
        f"TORCH = {torch.__version__.split('+')[0]!r}\n\n"
        f"{_table('HANDLED', 'list[int]', handled)}\n\n"
        f"{_table('REFUSED', 'str', refused)}\n\n"
        f"{_by_release(measured)}\n\n"
        "#: The transformers defaults model_types.small_config reads, per handled type (no import at restart).\n"
        f"{_table('RECIPES', 'dict', recipes)}\n"
    )
    _RESULTS.write_text(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m adstore.integration.reference.survey", description=__doc__.split("\n")[0]
    )
    p.add_argument("types", nargs="*", help="model types (default: every causal-LM type of transformers)")
    p.add_argument("--write", action="store_true", help="regenerate survey_results.py with these verdicts")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch_compile runs")
    p.add_argument("--jobs", type=int, default=2, help="model types checked at once (default 2)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per model type (default 900)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        import logging
        import warnings

        logging.disable(logging.WARNING)
        warnings.simplefilter("ignore")
        print(json.dumps(check(args.one, compile=args.compile)), flush=True)
        return 0
    types = args.types or model_types()
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        verdicts = []
        for v in pool.map(lambda t: _check_in_child(t, args.compile, args.timeout), types):
            verdicts.append(v)
            said = v["matches"] if v["handled"] else v["why"]
            print(f"{v['model_type']:<28} {'handled' if v['handled'] else 'refused':<8} {said}", flush=True)
    if args.write:
        _write(verdicts)
    print(f"{sum(v['handled'] for v in verdicts)} of {len(verdicts)} handled", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
