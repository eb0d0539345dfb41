"""`benchmark/bench_smc.py` on a small population: its two forms (lists and handles) send
the same requests and get the same rows, so its timings compare like with like. No timing."""

import pytest
from bench_smc import run_smc


@pytest.mark.parametrize("backend", ["mock", "hf"])
def test_lists_and_handles_give_the_same_rows_from_the_same_work(backend):
    result = run_smc(backend, prompt_tokens=40, particles=8, steps=6, seed=1)
    lists, handles = result["forms"]["lists"], result["forms"]["handles"]
    assert result["bitwise_equal"], result["largest_difference"]
    assert lists["computed"] == handles["computed"] > 0
    assert len(lists["hosts"]) == len(handles["hosts"]) == 6
