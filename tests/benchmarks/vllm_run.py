"""One real vLLM start on a tiny random Llama, offline: the tokens, vLLM's engine-init time, start to first output.

Runs in the venv of ``vllm_env.py`` (vLLM is not in the project venv)::

    python vllm_run.py make-model DIR          # random-weight Llama + word-level tokenizer, no network
    python vllm_run.py run --model DIR [--eager] [--max-tokens 8] [--log FILE] [--tp 2] [--vllm-defaults]

``run`` prints one JSON line: ``tokens`` (greedy, so identical in every run
that computes the same thing), ``engine_init_s`` (vLLM's own figure, the line
"init engine (profile, create kv cache, warmup model) took X seconds" that the
EngineCore process logs: it covers loading the weights, ``torch.compile`` and
the warm-up, and nothing of the imports; ``compilation_s`` is the part vLLM
counts as compiling), and ``process_to_output_s`` (from
this interpreter's start, as the kernel records it, to the generated tokens:
everything a user waits for).  With a few output tokens of a model this small,
the first token and the last are milliseconds apart.

vLLM starts its EngineCore in another process (spawned), whose logs go to the
file descriptors it inherits, so this script points descriptors 1 and 2 at a
file before importing vLLM, and reads the line from there.

Set here unless the caller set them: ``HF_HUB_OFFLINE=1`` (the model is a
directory), ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB; the default is 4) and, unless
``--vllm-defaults``, ``VLLM_USE_AOT_COMPILE=0`` (the runs that predate the
plugin's AOT fix keep their settings; ``--vllm-defaults`` leaves vLLM's own
default, AOT compile on).  ``--tp N`` serves with ``tensor_parallel_size=N``;
on CPU each rank is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``
``0|1|...`` unless the caller set it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["PROMPT", "make_model", "run"]

PROMPT = "the quick brown fox jumps over the lazy dog and the cat"
#: The tiny model: large enough to have every layer kind of a Llama, small enough to compile in seconds.
CONFIG = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 512,
    "vocab_size": 1024,
    "max_position_embeddings": 512,
}
#: vLLM 0.32.0 writes "took 12.34 s" (optionally "(compilation: 5.67 s)"); older releases wrote "seconds".
_INIT_LINE = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s(?:econds)?"
    r"(?: \(compilation: ([0-9.]+) s)?"
)
_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]


def make_model(directory: Path) -> None:
    """A random-weight Llama (safetensors) and a word-level tokenizer, built offline, saved in ``directory``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = sorted(set(PROMPT.split()))
    vocab_words = _SPECIAL + words + [f"w{i}" for i in range(CONFIG["vocab_size"] - len(_SPECIAL) - len(words))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab_words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    fast.save_pretrained(directory)


def _process_age() -> float:
    """Seconds since this process started, from ``/proc/self/stat`` (the kernel's clock ticks)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks after boot
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - started


def run(
    model: Path, *, eager: bool, max_tokens: int, log: Path | None, tp: int = 1, vllm_defaults: bool = False
) -> dict[str, object]:
    """Start vLLM on ``model``, generate ``max_tokens`` greedy tokens for :data:`PROMPT`; the figures."""
    settings = [("HF_HUB_OFFLINE", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")]
    if not vllm_defaults:
        settings.append(("VLLM_USE_AOT_COMPILE", "0"))
    if tp > 1:
        settings.append(("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))))
    for name, value in settings:
        os.environ.setdefault(name, value)
    out = tempfile.NamedTemporaryFile(prefix="vllm-run-", suffix=".log", delete=False)  # noqa: SIM115
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out.fileno(), 1)  # the EngineCore process inherits these: its log lines land in the file
    os.dup2(out.fileno(), 2)
    try:
        from vllm import LLM, SamplingParams

        llm = LLM(
            model=str(model),
            max_model_len=128,
            max_num_seqs=1,
            dtype="float32",
            enforce_eager=eager,
            seed=0,
            tensor_parallel_size=tp,
        )
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        result = llm.generate([PROMPT], params, use_tqdm=False)
        seconds = _process_age()
        tokens = list(result[0].outputs[0].token_ids)
        text = result[0].outputs[0].text
        llm.llm_engine.engine_core.shutdown()  # the EngineCore exits (and its store closes) before the log is read
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        out.close()
    captured = Path(out.name).read_text(errors="replace")
    if log is not None:
        log.write_text(captured)
    os.unlink(out.name)
    init = _INIT_LINE.findall(captured)
    return {
        "tokens": tokens,
        "text": text,
        "engine_init_s": float(init[-1][0]) if init else None,
        "compilation_s": float(init[-1][1]) if init and init[-1][1] else None,
        "process_to_output_s": seconds,
        "pid": os.getpid(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    make = sub.add_parser("make-model")
    make.add_argument("directory", type=Path)
    go = sub.add_parser("run")
    go.add_argument("--model", type=Path, required=True)
    go.add_argument("--eager", action="store_true", help="no torch.compile (enforce_eager): the floor")
    go.add_argument("--max-tokens", type=int, default=8)
    go.add_argument("--log", type=Path, help="keep vLLM's log (both processes) here")
    go.add_argument("--tp", type=int, default=1, help="tensor_parallel_size (CPU: one core per rank)")
    go.add_argument("--vllm-defaults", action="store_true", help="leave VLLM_USE_AOT_COMPILE at vLLM's default (on)")
    args = ap.parse_args()
    if args.command == "make-model":
        make_model(args.directory)
        return 0
    t0 = time.perf_counter()
    figures = run(
        args.model,
        eager=args.eager,
        max_tokens=args.max_tokens,
        log=args.log,
        tp=args.tp,
        vllm_defaults=args.vllm_defaults,
    )
    figures["in_process_s"] = time.perf_counter() - t0
    print(json.dumps(figures), flush=True)
    return 0


if __name__ == "__main__":  # vLLM spawns its EngineCore: this module is imported again there
    raise SystemExit(main())
