"""Command line: ``python -m genlm.backend sis --prompt "Montreal is" --particles 10``.

``sis`` runs the README's autobatched sequential importance sampler: every
particle is an asyncio task awaiting ``next_token_logprobs``; the library
batches their requests. Particles propose from the model at ``--temperature``
and are weighted by p/q towards the model itself, so at temperature 1 all
weights are equal and other temperatures show the reweighting at work.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class Particle:
    """One sample: its generated token ids and log importance weight."""

    token_ids: list[int] = field(default_factory=list)
    log_weight: float = 0.0
    finished: bool = False


async def run_sis(
    llm,
    prompt_ids: Sequence[int],
    n_particles: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int = 0,
    on_token=None,
) -> list[Particle]:
    """Sequential importance sampling with proposal ``p^(1/temperature)`` and target ``p``."""
    import torch

    eos = {llm.tokenizer.eos_token_id} - {None}

    async def particle(index: int) -> Particle:
        generator = torch.Generator().manual_seed(seed + index)
        state = Particle()
        for _ in range(max_tokens):
            logps = await llm.next_token_logprobs(list(prompt_ids) + state.token_ids)
            proposal = torch.log_softmax(logps / temperature, dim=-1)
            token = int(torch.multinomial(proposal.exp(), 1, generator=generator).item())
            state.log_weight += float(logps[token] - proposal[token])
            if on_token is not None:
                on_token()
            if token in eos:
                state.finished = True
                break
            state.token_ids.append(token)
        return state

    return list(await asyncio.gather(*(particle(i) for i in range(n_particles))))


def _normalized_weights(particles: Sequence[Particle]) -> list[float]:
    top = max(p.log_weight for p in particles)
    weights = [math.exp(p.log_weight - top) for p in particles]
    total = sum(weights)
    return [w / total for w in weights]


def sis_command(args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    from genlm.backend.llm import load_model_by_name

    model = args.model
    if model is None:
        from genlm.backend.models import default_model_path

        try:
            model = str(default_model_path())
        except ImportError as error:
            raise SystemExit(f"error: {error}") from None
    started = time.perf_counter()
    llm = load_model_by_name(model, backend=args.backend, llm_opts=llm_options(args))
    print(f"Loaded {model} with {type(llm).__name__} in {time.perf_counter() - started:.1f} s")

    prompt_ids = llm.tokenizer.encode(args.prompt, add_special_tokens=False)
    if not prompt_ids:
        raise SystemExit(f"error: --prompt {args.prompt!r} encodes to no tokens")
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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m genlm.backend", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sis = commands.add_parser("sis", help="autobatched sequential importance sampling demo")
    sis.add_argument("--prompt", default="Montreal is")
    sis.add_argument("--particles", type=positive_int, default=10)
    sis.add_argument("--max-tokens", type=positive_int, default=10)
    sis.add_argument("--temperature", type=positive_float, default=1.0)
    sis.add_argument("--seed", type=int, default=0)
    sis.add_argument(
        "--model", default=None, help="hub id, local dir or .gguf file (default: offline SmolLM2)"
    )
    sis.add_argument(
        "--backend",
        default=None,
        choices=["hf", "vllm", "mlx", "sgl", "mock"],
        help="default: vllm when CUDA is available, else hf",
    )
    sis.add_argument(
        "--dtype", default=None, choices=DTYPES, help="hf (default float32), vllm or sgl dtype"
    )
    sis.set_defaults(handler=sis_command)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse and check every argument (errors exit with status 2), then run the command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.prompt:
        parser.error("argument --prompt: must not be empty")
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
    args.handler(args)


if __name__ == "__main__":
    main()
