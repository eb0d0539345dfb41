"""The GPU set-up, offline: locks/gpu.txt agrees with vLLM's own requirements (as its wheel
states them: locks/gpu-vllm.txt) and with pyproject's ranges; scripts/setup.sh picks the set
that fits the machine, with stand-ins for nvidia-smi, the Python and the architecture
(``--print-plan``: nothing is installed); the lock's per-Python lines are read as pip reads
them.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU_LOCK = ROOT / "locks" / "gpu.txt"
VLLM_METADATA = ROOT / "locks" / "gpu-vllm.txt"
# The extras of the GPU set: the CPU set's but mlx (Apple's), with vllm; never sglang's.
GPU_EXTRAS = ("test", "docs", "lora", "bnb", "vllm")
# NVIDIA's oldest drivers for CUDA 13 (vLLM 0.33's kernels) and CUDA 12 (torch's cu126).
CUDA13_DRIVER, CUDA12_DRIVER = 580, 525


def header_field(name: str) -> str:
    (value,) = re.findall(rf"^# {name}: (.*)$", GPU_LOCK.read_text(), re.M)
    return value


def lock_pythons() -> list[str]:
    return header_field("python").split()


def environment(python: str) -> dict[str, str]:
    """Marker values of CPython ``python`` on Linux x86_64, the lock's platform."""
    return {
        "python_version": python,
        "python_full_version": f"{python}.0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "platform_machine": "x86_64",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "extra": "",
    }


def pins_for(python: str) -> dict[str, Version]:
    """The lock's pins that apply on ``python``, read with packaging (as pip reads them)."""
    pins = {}
    for line in GPU_LOCK.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(environment(python)):
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            name = canonicalize_name(requirement.name)
            assert name not in pins, f"{name} pinned twice for Python {python}"
            pins[name] = Version(specifier.version)
    return pins


def vllm_metadata() -> tuple[str, list[str]]:
    """vLLM's Requires-Python and Requires-Dist lines, as locks/gpu-vllm.txt records them."""
    text = VLLM_METADATA.read_text()
    (python,) = re.findall(r"^Requires-Python: (.*)$", text, re.M)
    return python, re.findall(r"^Requires-Dist: (.*)$", text, re.M)


def applies(requirement: Requirement, python: str) -> bool:
    return requirement.marker is None or requirement.marker.evaluate(environment(python))


def test_the_lock_covers_the_pythons_vllm_supports_and_no_other():
    from packaging.specifiers import SpecifierSet

    supported, _ = vllm_metadata()
    pythons = lock_pythons()
    assert pythons == sorted(pythons, key=Version) and "3.11" in pythons
    assert all(f"{p}.0" in SpecifierSet(supported) for p in pythons)
    newer = f"3.{int(pythons[-1].split('.')[1]) + 1}.0"
    older = f"3.{int(pythons[0].split('.')[1]) - 1}.0"
    assert newer not in SpecifierSet(supported) and older not in SpecifierSet(supported)


@pytest.mark.parametrize("python", lock_pythons())
def test_every_pin_of_vllm_holds_in_the_lock(python):
    """Each of vLLM's requirements for Linux x86_64 is in the lock at a version it allows:
    torch, torchvision, torchaudio, transformers, numba, its CUDA 13 kernels and the rest."""
    pins = pins_for(python)
    _, requires = vllm_metadata()
    checked = set()
    for line in requires:
        requirement = Requirement(line)
        if not applies(requirement, python):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"vLLM requires {line!r}; the lock has no {name} for {python}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"vLLM requires {line!r}; the lock pins {name}=={pins[name]} for {python}"
        )
        checked.add(name)
    assert {"torch", "torchvision", "torchaudio", "transformers", "numba"} <= checked


def test_the_lock_is_vllms_release_whose_requirements_are_recorded():
    (wheel,) = re.findall(r"of (vllm-\S+\.whl)'s METADATA", VLLM_METADATA.read_text())
    assert wheel.endswith("x86_64.whl")
    for python in lock_pythons():
        assert f"vllm-{pins_for(python)['vllm']}-" in wheel


@pytest.mark.parametrize("python", lock_pythons())
def test_every_requirement_of_pyproject_holds_in_the_lock(python):
    """The package's own requirements (core and the GPU set's extras) and the client
    libraries' pins are in the lock at versions their ranges allow; mlx and sglang are not."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in GPU_EXTRAS:
        lines += project["optional-dependencies"][extra]
    clients = (ROOT / "scripts" / "client-requirements.txt").read_text().splitlines()
    lines += [line for line in clients if line and not line.startswith("#")]
    pins = pins_for(python)
    for line in lines:
        requirement = Requirement(line)
        if not applies(requirement, python):
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"pyproject requires {line!r}; the lock has no {name} for {python}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"pyproject requires {line!r}; the lock pins {name}=={pins[name]} for {python}"
        )
    assert not {"mlx", "mlx-lm", "sglang"} & set(pins)


def test_the_header_names_the_cuda_of_the_locked_torch_and_its_driver():
    for python in lock_pythons():
        runtime = pins_for(python)["nvidia-cuda-runtime"]
        assert header_field("cuda") == str(runtime.major) == "13"
    assert header_field("driver").split()[0] == str(CUDA13_DRIVER)
    assert "x86_64" in header_field("platform")


# -- the lock as scripts/setup.sh reads it ------------------------------------------------------


def bash(command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True
    )


@pytest.mark.parametrize("python", lock_pythons())
def test_lock_pins_reads_each_pythons_lines_as_pip_does(python):
    run = bash(f"source scripts/lock_pins.sh && lock_pins locks/gpu.txt {python}")
    assert run.returncode == 0, run.stderr
    read = {}
    for line in run.stdout.splitlines():
        name, version = line.split("==")
        read[canonicalize_name(name)] = Version(version)
    assert read == pins_for(python)


def test_canonical_names_are_packagings():
    names = ["PyYAML", "jaraco.classes", "huggingface_hub", "Cython", "pyyaml_env_tag", "a--b_.c"]
    run = subprocess.run(
        ["bash", "-c", "source scripts/lock_pins.sh && canonical_names"],
        cwd=ROOT,
        input="".join(f"{name}==1.0\n" for name in names) + "pkg @ file:///x\n",
        capture_output=True,
        text=True,
    )
    expected = [f"{canonicalize_name(name)}==1.0" for name in names] + ["pkg @ file:///x"]
    assert run.stdout.splitlines() == expected


# -- which set the machine gets -------------------------------------------------------------------


def stand_in(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return path


def plan(tmp_path: Path, driver: str | None, python="3.11.7", machine="x86_64", *args: str):
    """``setup.sh --print-plan``'s line on a machine whose nvidia-smi prints ``driver``
    (None: it fails), whose Python is ``python`` and architecture ``machine``; asserts
    that nothing but the plan ran (the Python was asked its version, nothing else)."""
    calls = tmp_path / "python-calls"
    fake_python = stand_in(
        tmp_path / "python",
        f'echo "$*" >>"{calls}"\n[ "$*" = -V ] && echo "Python {python}"\n',
    )
    query = "--query-gpu=driver_version --format=csv,noheader"
    smi = stand_in(
        tmp_path / "nvidia-smi",
        "echo 'NVIDIA-SMI has failed' >&2; exit 9\n"
        if driver is None
        else f'[ "$*" = "{query}" ] || exit 2\necho "{driver}"\necho "{driver}"\n',
    )
    env = {**os.environ, "PYTHON": str(fake_python), "GENLM_NVIDIA_SMI": str(smi)}
    env["GENLM_MACHINE"] = machine
    run = subprocess.run(
        ["bash", "scripts/setup.sh", "--print-plan", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    assert set(calls.read_text().splitlines()) == {"-V"}
    (line,) = run.stdout.splitlines()
    return line


def test_a_recent_driver_on_x86_64_gets_the_gpu_set(tmp_path):
    pins = pins_for("3.11")
    line = plan(tmp_path, f"{CUDA13_DRIVER}.159")
    assert line.startswith("gpu: ")
    assert f"vLLM {pins['vllm']}" in line and f"torch {pins['torch']}" in line
    assert "locks/gpu.txt" in line


@pytest.mark.parametrize(
    "driver, python, machine, why",
    [
        (f"{CUDA13_DRIVER - 1}.99", "3.11.7", "x86_64", f"older than R{CUDA13_DRIVER}"),
        (f"{CUDA12_DRIVER}.60.13", "3.11.7", "x86_64", f"older than R{CUDA13_DRIVER}"),
        (f"{CUDA13_DRIVER}.1", "3.10.14", "x86_64", "needs Python 3.11, "),
        (f"{CUDA13_DRIVER}.1", "3.15.0", "x86_64", "this is 3.15"),
        (f"{CUDA13_DRIVER}.1", "3.12.3", "aarch64", "this is aarch64"),
    ],
)
def test_a_machine_that_cannot_take_the_gpu_set_gets_cuda_torch_and_says_why(
    tmp_path, driver, python, machine, why
):
    line = plan(tmp_path, driver, python, machine)
    assert line.startswith("cuda: ") and why in line
    assert "CUDA 12.6" in line and "HF backend" in line and "no vLLM" in line


@pytest.mark.parametrize(
    "driver, why",
    [
        (None, "no NVIDIA driver"),
        ("", "no NVIDIA driver"),
        ("not a version", "no NVIDIA driver"),
        (f"{CUDA12_DRIVER - 1}.1", f"older than R{CUDA12_DRIVER}"),
    ],
)
def test_no_driver_or_one_too_old_for_cuda_12_gets_the_cpu_set(tmp_path, driver, why):
    line = plan(tmp_path, driver)
    assert line.startswith("cpu: ") and why in line


def test_a_missing_nvidia_smi_and_latest_get_the_cpu_set(tmp_path):
    env = {**os.environ, "GENLM_NVIDIA_SMI": str(tmp_path / "absent")}
    run = bash("bash scripts/setup.sh --print-plan", env)
    assert run.stdout.startswith("cpu: no NVIDIA driver"), run.stderr
    assert plan(tmp_path, f"{CUDA13_DRIVER}.1", "3.11.7", "x86_64", "--latest").startswith(
        "cpu: --latest"
    )


def test_the_cuda_set_takes_torchs_cu126_build_from_pytorchs_cu126_index():
    run = bash(
        "source scripts/install_torch.sh && use_torch_build $TORCH_CUDA_BUILD"
        ' && echo "$TORCH_SPEC $TORCH_INDEX $TORCH_CUDA_DRIVER"',
        {k: v for k, v in os.environ.items() if not k.startswith("TORCH_")},
    )
    spec, index, driver = run.stdout.split()
    if os.uname().sysname == "Linux":
        assert spec.endswith("+cu126")
    assert index == "https://download.pytorch.org/whl/cu126" and driver == str(CUDA12_DRIVER)


def test_the_lock_has_no_marker_pip_cannot_read_for_the_lock_pythons():
    """Every marker is a `python_version == "X.Y"` of a Python the lock covers, the form
    lock_pins reads."""
    pythons = set(lock_pythons())
    for line in GPU_LOCK.read_text().splitlines():
        if ";" in line and not line.startswith("#"):
            marker = line.split(";", 1)[1].strip()
            Marker(marker)
            (python,) = re.fullmatch(r'python_version == "(3\.\d+)"', marker).groups()
            assert python in pythons, line
