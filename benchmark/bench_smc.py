"""Sequential Monte Carlo with lists and with handles: the host work of a step, side by side.

Each configuration (a backend, a prompt length) runs one SMC population twice in one
process, in lockstep: once with each particle's context a list of ids, once with a
`PrefixHandle`, each form on its own LM (its own caches) over the same model. A step of a
form: every particle extends its context by its drawn token (``context + [token]``), takes
its resampled ancestor's context (shared, as a careful client writes it: no copies), and
awaits its own ``next_token_logprobs`` as an asyncio task. The draws (tokens, then
multinomial resampling on a fixed random potential over the vocabulary) are made once per
step from the list form's rows and given to both forms, so both send the same requests;
the rows of the two forms are compared at every step (bitwise on the mock, within 1e-6 on
HF), and so are the tokens each form's model forwarded (HF) or the rows it computed (mock).
Which form steps first alternates from step to step.

``host_ms``: the median over the steps after ``--warmup`` of a step's wall time (the
extension, the resampling and the requests; the draws are outside) less the time in the
model's forward and LM head (HF; hooks, as `bench_host.ForwardClock`); the mock has no
forward. Each repeat is a fresh process (glibc's malloc thresholds fixed, as bench_host's);
a figure is the median over the repeats.

Issue 47's targets at 128 particles: host ms with handles at most 0.85x the list form's at
1,024 tokens and at most 1.02x at 64.

    python benchmark/bench_smc.py                      # mock and HF, prompts of 64 and 1,024
    python benchmark/bench_smc.py --backend mock --repeats 1 --steps 16    # a quick look

Results: a table, and benchmark/results/smc.json.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCHMARK_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARK_DIR))

# bench_host sets the environment (one torch thread, offline) before anything imports torch.
from bench_host import FIXED_MALLOC, ForwardClock, tiny_model  # noqa: E402

FORMS = ("lists", "handles")
# The columns of the docs' table (a row also holds each repeat's host ms).
TABLE = [
    "backend",
    "prompt_tokens",
    "lists_host_ms",
    "handles_host_ms",
    "handles_vs_lists",
    "lists_computed",
    "handles_computed",
    "bitwise_equal",
]
HF_TOLERANCE = 1e-6


class SMCForm:
    """One form's population on its own LM: its contexts, its clock and what its model
    computed (tokens forwarded on HF, rows on the mock)."""

    def __init__(self, lm: Any, start: Any, particles: int, model: Any = None):
        self.lm = lm
        self.contexts = [start] * particles
        self.clock = None if model is None else ForwardClock(model, lm.runner.forward.head)
        self.hosts: list[float] = []
        self.computed = 0
        if model is None:
            compute = lm._compute_batch

            def counted(keys: list[Any]) -> Any:
                self.computed += len(keys)
                return compute(keys)

            lm._compute_batch = counted
        else:
            self._hook = model.base_model.register_forward_pre_hook(
                self._count_tokens, with_kwargs=True
            )

    def _count_tokens(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.computed += ids.numel()

    def step(self, loop: asyncio.AbstractEventLoop, tokens: list[int], ancestors: list[int]):
        """Extend every context by its token, resample, then each particle's row (timed)."""
        if self.clock is not None:
            self.clock.seconds = 0.0
        lm = self.lm
        start = time.perf_counter()
        extended = [c + [t] for c, t in zip(self.contexts, tokens, strict=True)]
        self.contexts = [extended[a] for a in ancestors]

        async def rows() -> list[Any]:
            return await asyncio.gather(*(lm.next_token_logprobs(c) for c in self.contexts))

        result = loop.run_until_complete(rows())
        wall = time.perf_counter() - start
        self.hosts.append(wall - (0.0 if self.clock is None else self.clock.seconds))
        return result

    def close(self) -> None:
        if self.clock is not None:
            self.clock.remove()
            self._hook.remove()
        self.lm.close()


def run_smc(backend: str, prompt_tokens: int, particles: int, steps: int, seed: int):
    """Both forms in lockstep in this process: per-form host seconds per step, the tokens
    or rows each computed, and the largest difference between their rows."""
    import torch

    model, tokenizer = tiny_model()
    if backend == "mock":
        from genlm.backend.llm import MockAsyncLM

        make = lambda: MockAsyncLM(tokenizer, batch_size=particles)  # noqa: E731
        forward_model = None
    else:
        from genlm.backend.llm.hf import AsyncTransformer

        make = lambda: AsyncTransformer(model, tokenizer, batch_size=particles)  # noqa: E731
        forward_model = model
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, len(tokenizer), (prompt_tokens,), generator=generator).tolist()
    potential = torch.randn(len(tokenizer), generator=generator)
    lists, handles = make(), make()
    forms = {
        "lists": SMCForm(lists, prompt, particles, forward_model),
        "handles": SMCForm(handles, handles.handle(prompt), particles, forward_model),
    }
    gc.collect()
    loop = asyncio.new_event_loop()
    first = {
        name: loop.run_until_complete(form.lm.next_token_logprobs(form.contexts[0]))
        for name, form in forms.items()
    }
    rows = first["lists"].expand(particles, -1)
    largest = (first["lists"] - first["handles"]).abs().max().item()
    bitwise = torch.equal(first["lists"], first["handles"])
    for step in range(steps):
        tokens = torch.multinomial(rows.exp(), 1, generator=generator).flatten()
        weights = potential[tokens].softmax(0)
        ancestors = torch.multinomial(weights, particles, True, generator=generator).tolist()
        order = FORMS if step % 2 == 0 else FORMS[::-1]
        answers = {
            name: torch.stack(forms[name].step(loop, tokens.tolist(), ancestors)) for name in order
        }
        rows = answers["lists"]
        bitwise = bitwise and torch.equal(rows, answers["handles"])
        largest = max(largest, (rows - answers["handles"]).abs().max().item())
    result = {
        name: {"hosts": form.hosts, "computed": form.computed} for name, form in forms.items()
    }
    for form in forms.values():
        form.close()
    loop.close()
    return {"forms": result, "largest_difference": largest, "bitwise_equal": bitwise}


def run_apart(backend: str, prompt_tokens: int, args: argparse.Namespace) -> dict[str, Any]:
    """`run_smc` in a fresh process (glibc's malloc thresholds fixed)."""
    command = [sys.executable, __file__, "--one", backend, str(prompt_tokens)]
    command += ["--particles", str(args.particles), "--steps", str(args.steps)]
    command += ["--seed", str(args.seed)]
    env = {**os.environ, **FIXED_MALLOC}
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.splitlines()[-1])


def summary(runs: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """A configuration over its repeats: each form's host ms (median over the steps after
    ``warmup``, then over the repeats), what it computed, and the rows' agreement."""
    out: dict[str, Any] = {}
    for name in FORMS:
        per_run = [1e3 * statistics.median(run["forms"][name]["hosts"][warmup:]) for run in runs]
        out[f"{name}_host_ms"] = statistics.median(per_run)
        out[f"{name}_host_ms_runs"] = per_run
        out[f"{name}_computed"] = runs[0]["forms"][name]["computed"]
    out["handles_vs_lists"] = out["handles_host_ms"] / out["lists_host_ms"]
    out["largest_difference"] = max(run["largest_difference"] for run in runs)
    out["bitwise_equal"] = all(run["bitwise_equal"] for run in runs)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", nargs="+", choices=["mock", "hf"], default=["mock", "hf"])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--particles", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8, help="steps left out of the medians")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes, round-robin")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=BENCHMARK_DIR / "results" / "smc.json")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # backend, prompt tokens
    args = parser.parse_args(argv)
    if args.one:
        backend, prompt_tokens = args.one[0], int(args.one[1])
        result = run_smc(backend, prompt_tokens, args.particles, args.steps, args.seed)
        print(json.dumps(result))
        return
    configurations = [(b, p) for b in args.backend for p in args.prompt_tokens]
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in configurations}
    print(f"{'backend':>7} {'prompt':>6} {'lists ms':>9} {'handles ms':>10} {'ratio':>6}  repeat")
    for repeat in range(args.repeats):  # round-robin: drift hits every configuration
        for backend, prompt_tokens in configurations:
            run = run_apart(backend, prompt_tokens, args)
            runs[backend, prompt_tokens].append(run)
            one = summary([run], args.warmup)
            print(
                f"{backend:>7} {prompt_tokens:>6} {one['lists_host_ms']:>9.2f} "
                f"{one['handles_host_ms']:>10.2f} {one['handles_vs_lists']:>6.3f}  "
                f"{repeat + 1} of {args.repeats}"
            )
    rows = []
    print("medians over the repeats:")
    for (backend, prompt_tokens), configuration_runs in runs.items():
        row = {"backend": backend, "prompt_tokens": prompt_tokens}
        row.update(summary(configuration_runs, args.warmup))
        rows.append(row)
        agreement = "bitwise" if row["bitwise_equal"] else f"{row['largest_difference']:.1e}"
        print(
            f"{backend:>7} {prompt_tokens:>6} {row['lists_host_ms']:>9.2f} "
            f"{row['handles_host_ms']:>10.2f} {row['handles_vs_lists']:>6.3f}  rows {agreement}, "
            f"computed {row['lists_computed']} / {row['handles_computed']}"
        )
    import torch

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "machine": platform.processor() or platform.machine(),
                "torch": torch.__version__,
                "particles": args.particles,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "hf_tolerance": HF_TOLERANCE,
                "table": TABLE,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
