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

        model = str(default_model_path())
    llm_opts = {}
    if args.backend in (None, "hf"):
        llm_opts["hf_opts"] = {"dtype": args.dtype}
    started = time.perf_counter()
    llm = load_model_by_name(model, backend=args.backend, llm_opts=llm_opts)
    print(f"Loaded {model} with {type(llm).__name__} in {time.perf_counter() - started:.1f} s")

    prompt_ids = llm.tokenizer.encode(args.prompt, add_special_tokens=False)
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m genlm.backend", description=__doc__.split("\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sis = commands.add_parser("sis", help="autobatched sequential importance sampling demo")
    sis.add_argument("--prompt", default="Montreal is")
    sis.add_argument("--particles", type=int, default=10)
    sis.add_argument("--max-tokens", type=int, default=10)
    sis.add_argument("--temperature", type=float, default=1.0)
    sis.add_argument("--seed", type=int, default=0)
    sis.add_argument(
        "--model", default=None, help="hub id, local dir or .gguf file (default: offline SmolLM2)"
    )
    sis.add_argument("--backend", default=None, choices=["hf", "vllm", "mlx", "sgl", "mock"])
    sis.add_argument("--dtype", default="float32", help="hf backend dtype (default float32)")
    sis.set_defaults(handler=sis_command)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.particles < 1 or args.max_tokens < 1:
        raise SystemExit("--particles and --max-tokens must be positive")
    if args.temperature <= 0:
        raise SystemExit("--temperature must be positive")
    args.handler(args)


if __name__ == "__main__":
    main()
