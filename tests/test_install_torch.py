"""scripts/install_torch.sh: the CPU build of torch, here (a local wheel directory) and on an
ordinary Linux machine (PyTorch's CPU index), with a stand-in pip that logs its calls."""

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def fake_pip(tmp_path: Path, succeeds_when: str) -> Path:
    """A pip that logs its arguments and succeeds only when they contain ``succeeds_when``
    (an empty string: always)."""
    pip = tmp_path / "pip"
    pip.write_text(
        "#!/usr/bin/env bash\n"
        f'echo "$*" >>"{tmp_path}/calls"\n'
        f'[[ "$*" == *"{succeeds_when}"* ]] || {{ echo "No matching distribution" >&2; exit 1; }}\n'
    )
    pip.chmod(0o755)
    return pip


def install_torch(pip: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = f'source scripts/install_torch.sh && install_torch "{pip}" -c pins.txt'
    run_env = {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")}
    return subprocess.run(
        ["bash", "-c", command],
        cwd=ROOT,
        env={**run_env, **(env or {})},
        capture_output=True,
        text=True,
    )


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the +cpu default is Linux's")
def test_where_the_configured_sources_hold_the_cpu_build_no_other_index_is_asked(tmp_path):
    pip = fake_pip(tmp_path, succeeds_when="")
    assert install_torch(pip).returncode == 0
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert call == "install -q -c pins.txt torch==2.13.0+cpu"


@pytest.mark.skipif(os.uname().sysname != "Linux", reason="the +cpu default is Linux's")
def test_an_ordinary_machine_gets_the_cpu_build_from_pytorchs_cpu_index(tmp_path):
    pip = fake_pip(tmp_path, succeeds_when=CPU_INDEX)
    result = install_torch(pip)
    assert result.returncode == 0, result.stderr
    first, second = (tmp_path / "calls").read_text().splitlines()
    assert first == "install -q -c pins.txt torch==2.13.0+cpu"
    assert second == f"install -q -c pins.txt --extra-index-url {CPU_INDEX} torch==2.13.0+cpu"
    assert f"trying PyTorch's index {CPU_INDEX}" in result.stderr


def test_torch_spec_overrides_the_requirement_and_a_failure_fails(tmp_path):
    pip = fake_pip(tmp_path, succeeds_when="no such argument")
    result = install_torch(pip, {"TORCH_SPEC": "torch==9.9"})
    assert result.returncode != 0
    calls = (tmp_path / "calls").read_text().splitlines()
    assert len(calls) == 2 and all(call.endswith(" torch==9.9") for call in calls)


def test_both_set_up_scripts_install_torch_through_it():
    for script in ("setup.sh", "install_check.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "source scripts/install_torch.sh" in text and "install_torch " in text, script
        assert "torch==2.13.0" not in text.replace("torch==2.13.0+cpu", ""), script
