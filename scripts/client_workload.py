"""Checks an installation of genlm-backend next to the client libraries, from the inside.

scripts/install_check.sh runs it with the Python of the fresh venv it made, outside the
repository (so nothing is imported from the checkout):

    python client_workload.py WHEEL VERSION             where things are, and which build
    python client_workload.py WHEEL VERSION --workload  then a short client workload
    python client_workload.py WHEEL VERSION --no-clients   genlm-backend alone (Python 3.10)

Where things are: ``genlm.backend`` is imported from the venv's site-packages, and is the
distribution pip installed from WHEEL (its direct_url.json names that file) at VERSION,
not PyPI's genlm-backend; genlm-control, genlm-bytes and llamppl are there too, and
``genlm`` is still a namespace package (no wheel installed ``genlm/__init__.py``).

The workload, on the offline default model (converted beforehand by the caller) with our
HF backend: genlm-control's ``PromptedLLM`` gives the next-token weights our backend
computes; SMC with direct token sampling (no resampling) finishes every particle with EOS
within the token budget; genlm-bytes' beam prefills a few bytes and gives a normalized next-byte
distribution; LLaMPPL's ``CachedCausalLM`` gives our rows, and its SMC (``smc_standard``)
runs a model of a few tokens, each particle's weight the sum of what its ``observe`` calls
added. It prints the sampled continuations.
"""

import argparse
import asyncio
import importlib.metadata
import json
import sysconfig
import warnings
from pathlib import Path

PROMPT = "The capital of France is"
MAX_TOKENS = 5


def check_install(wheel: Path, version: str, clients: bool = True) -> None:
    import genlm
    import genlm.backend

    modules = [genlm.backend]
    if clients:
        import genlm.bytes
        import genlm.control
        import llamppl

        modules += [genlm.control, genlm.bytes, llamppl]
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    for module in modules:
        where = Path(module.__file__).resolve()
        assert where.is_relative_to(site), f"{module.__name__} imported from {where}, not {site}"
    inits = [p for p in genlm.__path__ if (Path(p) / "__init__.py").exists()]
    assert not inits, f"genlm is no longer a namespace package: __init__.py in {inits}"

    dist = importlib.metadata.distribution("genlm-backend")
    assert dist.version == version, f"genlm-backend {dist.version} installed, not {version}"
    direct_url = json.loads(dist.read_text("direct_url.json") or "{}")
    assert direct_url.get("url") == wheel.resolve().as_uri(), (
        f"genlm-backend {dist.version} was not installed from {wheel.name} "
        f"(direct_url.json: {direct_url or 'none: a registry download'})"
    )
    print(f"genlm-backend {dist.version}, from {wheel.name}, imported from {site}")
    for name in ("genlm-control", "genlm-bytes", "llamppl") if clients else ():
        print(f"  next to {name} {importlib.metadata.version(name)}")


async def workload() -> None:
    import numpy as np
    import torch
    from genlm.bytes import BeamParams, ByteBeamState
    from genlm.control import EOS, SMC, PromptedLLM, direct_token_sampler

    from genlm.backend.llm import AsyncTransformer
    from genlm.backend.models import default_model_path

    torch.manual_seed(0)
    lm = AsyncTransformer.from_name(str(default_model_path()), hf_opts={"dtype": "float32"})
    llm = PromptedLLM(lm)
    llm.set_prompt_from_str(PROMPT)

    # The client's weights are our backend's log-probabilities: its non-EOS vocabulary,
    # then EOS.
    got = (await llm.logw_next([])).weights
    ours = await lm.next_token_logprobs(llm.prompt_ids)
    ids = torch.tensor([token.token_id for token in llm.vocab])
    expected = torch.cat([ours[ids], ours[lm.tokenizer.eos_token_id].reshape(1)])
    diff = (torch.as_tensor(got) - expected).abs().max().item()
    assert diff <= 1e-4, f"PromptedLLM.logw_next differs from next_token_logprobs by {diff}"

    smc = SMC(direct_token_sampler(llm))
    try:
        sequences = await smc(n_particles=4, ess_threshold=0.0, max_tokens=MAX_TOKENS)
    finally:
        await smc.cleanup()
    vocab = set(llm.vocab)
    assert len(sequences.contexts) == 4
    for context, log_weight in zip(sequences.contexts, sequences.log_weights, strict=True):
        assert context[-1] is EOS and 1 <= len(context) <= MAX_TOKENS, context
        assert all(token in vocab for token in context[:-1]), context
        assert np.isfinite(log_weight), log_weight
        text = b"".join(context[:-1]).decode("utf-8", "replace")
        print(f"  SMC particle: {PROMPT!r} + {text!r} (log weight {log_weight:.3f})")

    # genlm-bytes builds its sparse trie matrices without torch's invariant checks
    warnings.filterwarnings("ignore", "Sparse", UserWarning)
    beam = await ByteBeamState.initial(lm, BeamParams(K=4))
    try:
        beam = await beam.prefill(b"Hello, wor")
        next_byte = np.exp((await beam.logp_next()).ps)
    finally:
        await beam.cleanup()
    assert abs(next_byte.sum() - 1) <= 1e-6, next_byte.sum()
    best = int(next_byte.argmax())  # 256 and up: genlm-bytes' end markers
    shown = bytes([best]) if best < 256 else best
    print(f"  byte beam after b'Hello, wor': most likely next byte {shown!r}")

    await llamppl_workload(lm, ours, llm.prompt_ids)


async def llamppl_workload(lm, ours, prompt_ids) -> None:
    """LLaMPPL's rows are ours; its SMC runs a model that observes, at each step, that the
    next token has no letter "e" and then draws one from the model."""
    import numpy as np
    import torch
    from llamppl import CachedCausalLM, LMContext, Model, smc_standard

    llamppl_lm = CachedCausalLM(lm)
    rows = torch.from_numpy(await llamppl_lm.next_token_logprobs(prompt_ids))
    diff = (rows - ours).abs().max().item()
    assert diff <= 1e-4, f"CachedCausalLM.next_token_logprobs differs from ours by {diff}"

    forbidden = {i for i, token in enumerate(lm.str_vocab) if "e" in token}

    class NoE(Model):
        def __init__(self):
            super().__init__()
            self.context = LMContext(llamppl_lm, PROMPT)
            self.added = 0.0

        async def step(self):
            before = self.weight
            await self.observe(self.context.mask_dist(forbidden), False)
            self.added += self.weight - before
            await self.sample(self.context.next_token())
            if self.context.token_count >= MAX_TOKENS:
                self.finish()

    np.random.seed(0)
    for particle in await smc_standard(NoE(), 4, ess_threshold=1e-300):  # no resampling
        drawn = [int(t) for t in particle.context.tokens[particle.context.prompt_token_count :]]
        assert len(drawn) == MAX_TOKENS and not set(drawn) & forbidden, drawn
        assert abs(particle.weight - particle.added) <= 1e-4, (particle.weight, particle.added)
        print(
            f"  LLaMPPL particle: {PROMPT!r} + {str(particle.context)!r} (log weight "
            f"{particle.weight:.3f})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="the wheel genlm-backend must come from")
    parser.add_argument("version", help="the version it must have")
    parser.add_argument("--workload", action="store_true", help="also run the client workload")
    parser.add_argument("--no-clients", action="store_true", help="genlm-backend alone (3.10)")
    args = parser.parse_args()
    check_install(args.wheel, args.version, clients=not args.no_clients)
    if args.workload and not args.no_clients:
        asyncio.run(workload())


if __name__ == "__main__":
    main()
