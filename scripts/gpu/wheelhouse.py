"""The wheelhouse that ``make gpu-wheels`` fills here and the GPU commands install from there.

The GPU machine has its own Python 3.12 with PyTorch, transformers, peft, accelerate,
pyarrow, safetensors and tensorboard, and reaches no package registry; what it lacks of
what dapo's GPU tier and GPU benchmarks import (``requirements.txt`` beside this file)
travels as wheels in a carried folder (``.gpu/`` by default; with the working tree at most
64 MiB per command), with a copy of the warmed-up ``builtin:tiny`` so that the tier does not
spend its minutes building it.

    python scripts/gpu/wheelhouse.py fill  [--gpu-dir .gpu] [--no-model]   # here (PyPI)
    python3 scripts/gpu/wheelhouse.py check [--gpu-dir .gpu]               # there: the plan

:func:`plan` decides, on the machine where the commands run, which wheels to install: those
of the required packages the machine does not have (a package it has is used as it is, so
nothing of the image is shadowed). It reports required packages that are neither installed
nor carried, a package carried in two versions (pip would refuse the whole install), and
requirements of the wheels to install that the machine does not meet.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
REQUIREMENTS = HERE / "requirements.txt"
LIMIT_BYTES = 64 * 2**20  # what one device command may carry, working tree included
PYTHON_VERSION = "3.12"  # the GPU image's
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")


def canonical(name: str) -> str:
    """A distribution name as pip compares them (PEP 503): ``Math_Verify`` -> ``math-verify``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: Path = REQUIREMENTS) -> dict[str, str]:
    """``{canonical name: version}`` of the ``name==version`` lines (comments ignored)."""
    out = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"{path}:{n}: {raw.strip()!r} is not of the form name==version")
        out[canonical(name.strip())] = version.strip()
    return out


def wheel_name(path: Path) -> tuple[str, str]:
    """``(canonical name, version)`` from a wheel's file name."""
    parts = path.name.split("-")
    if not path.name.endswith(".whl") or len(parts) < 5:
        raise ValueError(
            f"{path.name} is not a wheel file name (name-version-python-abi-platform.whl)"
        )
    return canonical(parts[0]), parts[1]


def installed_distributions() -> dict[str, str]:
    """``{canonical name: version}`` of what this Python can import."""
    return {
        canonical(d.metadata["Name"]): d.version
        for d in metadata.distributions()
        if d.metadata["Name"]
    }


def requires(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines that apply here (no extras)."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    lines = [
        x.split(":", 1)[1].strip() for x in text.splitlines() if x.startswith("Requires-Dist:")
    ]
    try:
        from packaging.requirements import Requirement
    except ImportError:  # no packaging: keep those without markers
        return [x for x in lines if ";" not in x]
    env = {"python_version": PYTHON_VERSION, "extra": ""}
    return [
        x for x in lines if Requirement(x).marker is None or Requirement(x).marker.evaluate(env)
    ]


def unmet(requirement: str, available: dict[str, str]) -> str | None:
    """Why ``requirement`` (a Requires-Dist line) is not met by ``available``, or None."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import InvalidVersion, Version
    except ImportError:
        name = canonical(re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0])
        return None if name in available else f"{name} is missing"
    req = Requirement(requirement)
    name = canonical(req.name)
    if name not in available:
        return f"{name} is missing"
    try:
        ok = req.specifier.contains(Version(available[name]), prereleases=True)
    except InvalidVersion:
        ok = True
    return None if ok else f"{name} {available[name]} does not meet {req.specifier}"


@dataclass
class Plan:
    """What to install from the wheelhouse on this machine."""

    install: list[str] = field(default_factory=list)  # wheel file names
    present: dict[str, str] = field(default_factory=dict)  # required, already installed: version
    missing: list[str] = field(default_factory=list)  # required, neither installed nor carried
    duplicates: list[str] = field(default_factory=list)  # carried in more than one version
    unmet: list[str] = field(default_factory=list)  # needs of the wheels to install
    wheel_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.duplicates)

    def problems(self) -> list[str]:
        out = [
            f"{n} is neither installed nor in the wheelhouse (make gpu-wheels, then carry "
            "the folder)"
            for n in self.missing
        ]
        out += [
            f"{n} is in the wheelhouse more than once: keep one version" for n in self.duplicates
        ]
        return out + [f"needed by a wheel: {x}" for x in self.unmet]


def plan(wheel_dir: Path, required: dict[str, str], installed: dict[str, str]) -> Plan:
    """The wheels of ``wheel_dir`` to install for ``required`` on a machine with ``installed``."""
    wheels: dict[str, list[Path]] = {}
    for w in sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []:
        wheels.setdefault(wheel_name(w)[0], []).append(w)
    p = Plan(duplicates=sorted(n for n, ws in wheels.items() if len(ws) > 1))
    p.wheel_bytes = sum(w.stat().st_size for ws in wheels.values() for w in ws)
    chosen: list[Path] = []
    for name in required:
        if name in installed:
            p.present[name] = installed[name]
        elif name in wheels:
            chosen.append(wheels[name][-1])
        else:
            p.missing.append(name)
    p.install = [w.name for w in chosen]
    available = {**installed, **{wheel_name(w)[0]: wheel_name(w)[1] for w in chosen}}
    for w in chosen:
        p.unmet += [
            f"{wheel_name(w)[0]}: {why}" for r in requires(w) if (why := unmet(r, available))
        ]
    return p


def install(wheel_dir: Path, p: Plan, target: Path, python: str = sys.executable) -> None:
    """pip-install ``p.install`` into ``target`` (no index, no dependencies: the plan has them)."""
    if not p.install:
        return
    cmd = [
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *(str(wheel_dir / w) for w in p.install),
    ]
    subprocess.run(cmd, check=True)


def tree_bytes(root: Path = ROOT) -> int:
    """Bytes of the working tree that travels to the GPU machine (git's tracked and untracked,
    not ignored, files); 0 where git cannot tell."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "-co", "--exclude-standard"],
            cwd=root,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    files = [root / f for f in out.decode().split("\0") if f]
    return sum(f.stat().st_size for f in files if f.is_file())


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def download(names: dict[str, str], dest: Path) -> None:
    """pip-download the pinned wheels (no dependencies) for CPython 3.12 on x86-64 Linux."""
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PYTHON_VERSION,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        *(f"{n}=={v}" for n, v in names.items()),
    ]
    subprocess.run(cmd, check=True)


def copy_model(cache: Path, name: str = "builtin:tiny") -> Path:
    """The warmed-up built-in model (built here if needed), copied under ``cache``."""
    from dapo.models import resolve_model_path

    source = Path(resolve_model_path(name, log=print))
    target = cache / source.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target)
    return target


def fill(gpu_dir: Path, required: dict[str, str], *, model: bool = True) -> dict:
    """Download the wheels of ``required`` into ``gpu_dir/wheels`` (dropping any other wheel),
    copy the built-in model to ``gpu_dir/cache``, write ``gpu_dir/manifest.json``; raises
    ``SystemExit`` when the wheelhouse or the whole carried tree is over :data:`LIMIT_BYTES`."""
    wheels = gpu_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download(required, wheels)
    for w in wheels.glob("*.whl"):
        name, version = wheel_name(w)
        if required.get(name) != version:
            w.unlink()  # another version, or no longer required
    if model:
        copy_model(gpu_dir / "cache")
    p = plan(wheels, required, installed={})
    if not p.ok:
        raise SystemExit("make gpu-wheels: " + "; ".join(p.problems()))
    manifest = {
        "python": PYTHON_VERSION,
        "wheels": {w.name: w.stat().st_size for w in sorted(wheels.glob("*.whl"))},
        "wheel_bytes": p.wheel_bytes,
        "gpu_dir_bytes": folder_bytes(gpu_dir),
        "tree_bytes": tree_bytes(),
        "limit_bytes": LIMIT_BYTES,
    }
    (gpu_dir / "manifest.json").write_text(json.dumps(manifest, indent=1))
    total = manifest["gpu_dir_bytes"] + manifest["tree_bytes"]
    mib = 2**20
    print(
        f"{gpu_dir}: {len(manifest['wheels'])} wheels, {p.wheel_bytes / mib:.1f} MiB; the folder "
        f"{manifest['gpu_dir_bytes'] / mib:.1f} MiB, with the working tree "
        f"{total / mib:.1f} MiB of the {LIMIT_BYTES // mib} MiB a command may carry"
    )
    if total >= LIMIT_BYTES:
        raise SystemExit(
            f"make gpu-wheels: {total / mib:.1f} MiB would travel, over the limit of "
            f"{LIMIT_BYTES // mib} MiB: drop wheels from {REQUIREMENTS}"
        )
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("command", choices=["fill", "check"])
    ap.add_argument("--gpu-dir", type=Path, default=ROOT / ".gpu", help="the carried folder")
    ap.add_argument("--requirements", type=Path, default=REQUIREMENTS)
    ap.add_argument("--no-model", action="store_true", help="fill: leave builtin:tiny out")
    args = ap.parse_args(argv)
    required = read_requirements(args.requirements)
    if args.command == "fill":
        fill(args.gpu_dir, required, model=not args.no_model)
        return 0
    p = plan(args.gpu_dir / "wheels", required, installed_distributions())
    print(json.dumps(asdict(p), indent=1))
    for problem in p.problems():
        print(f"warning: {problem}", file=sys.stderr)
    return 0 if p.ok else 1


if __name__ == "__main__":
    sys.exit(main())
