#!/usr/bin/env python3
"""Build and test Chariot's container images with whichever builder this machine has (docs/images.md).

    python3 .ci/images.py builder            which builder a build would use, and why
    python3 .ci/images.py build cpu|cuda     `make image-cpu`, `make image-cuda` (`make image`)
    python3 .ci/images.py test cpu [cuda]    `make image-test`: build, then check inside as uid 10001

The standard library only: it runs before, and without, the project's virtual environment.
Settings come from the environment (the Makefile passes its command-line variables through):

  CONTAINER_BUILDER  docker | podman | buildah (default: the first that works; buildah is installed
                     with apt-get when none does)
  BASE_IMAGE         the image both stages start from (default python:3.11-slim; when that cannot
                     be pulled, a Debian bookworm base made with mmdebstrap)
  TORCH_INDEX_URL    where torch comes from (default: PyTorch's CPU index for cpu, PyPI for cuda)
  TORCH_WHEELS       a directory of wheels to install torch from instead (offline builds); when the
                     index is unreachable, the torch wheel in pip's own find-links is used
  TORCH_VERSION      default: the Dockerfile's
  CA_BUNDLE          the CA bundle pip inside the build trusts (default: the system's; `none`: no bundle)
  PIP_INDEX_URL      passed to the build for chariot's other dependencies when set (a mirror)
  PIP_NO_INDEX       passed when set: nothing from an index (all wheels in TORCH_WHEELS: air-gapped)
  IMAGE_REPO         default ghcr.io/chariot-serving/chariot (the Helm chart's image.repository)
  IMAGE_NAMES        names to tag instead of the default ones (skaffold passes its $IMAGE)
  IMAGE_PUSH         true: push the tagged names after the build
  IMAGE_RECORD       test: also write the results to this JSON file (e.g. docs/img/images.json)
  BUILDAH_ISOLATION  buildah's isolation (default chroot: needs no OCI runtime)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
CHART = ROOT / "charts" / "chariot" / "Chart.yaml"
INPUTS = ROOT / "build" / "image-inputs"  # the build context's optional inputs (.dockerignore lets it in)
WORKDIR = Path(os.environ.get("IMAGE_WORKDIR", "/var/tmp/chariot-images"))  # base tarball, test logs

BUILDERS = ("docker", "podman", "buildah")
FLAVOURS = ("cpu", "cuda")
DEFAULT_REPO = "ghcr.io/chariot-serving/chariot"
DEFAULT_BASE = "python:3.11-slim"
MMDEBSTRAP_PACKAGES = "python3,python3-venv,python3-dev,python-is-python3,ca-certificates"
LOCAL_BASE = {"docker": "chariot-base:bookworm", "podman": "localhost/chariot-base:bookworm",
              "buildah": "localhost/chariot-base:bookworm"}
TORCH_INDEX = {"cpu": "https://download.pytorch.org/whl/cpu", "cuda": "https://pypi.org/simple"}
SYSTEM_CA_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
USER = "10001:10001"


class ImageError(RuntimeError):
    """A build or check that cannot go on; the message says what to do."""


def log(msg: str) -> None:
    print(f"[images] {msg}", file=sys.stderr, flush=True)


# --- what the repository says ------------------------------------------------------------------

def chart_version(chart: Path = CHART) -> str:
    """The chart's appVersion: the tag its default image has, and the one `make image` gives."""
    match = re.search(r'^appVersion:\s*"?([^"\s]+)"?', chart.read_text(), re.M)
    if not match:
        raise ImageError(f"no appVersion in {chart}")
    return match.group(1)


def dockerfile_arg(name: str, dockerfile: Path = DOCKERFILE) -> str:
    match = re.search(rf"^ARG {name}=(\S+)", dockerfile.read_text(), re.M)
    if not match:
        raise ImageError(f"no default for ARG {name} in {dockerfile}")
    return match.group(1)


def image_names(flavour: str, env: Mapping[str, str], version: str | None = None) -> list[str]:
    """What a build of `flavour` is tagged: <repo>:<version>-<flavour>, and the CUDA image also
    <repo>:<version>, the Helm chart's default (it runs on GPU and CPU nodes alike)."""
    if env.get("IMAGE_NAMES"):
        return env["IMAGE_NAMES"].split()
    repo = env.get("IMAGE_REPO") or DEFAULT_REPO
    version = version or chart_version()
    names = [f"{repo}:{version}-{flavour}"]
    if flavour == "cuda":
        names.append(f"{repo}:{version}")
    return names


# --- the builder -------------------------------------------------------------------------------

Probe = Callable[[Sequence[str]], "tuple[bool, str]"]


def probe(cmd: Sequence[str]) -> tuple[bool, str]:
    """Whether `cmd` exits 0 (within 60 s), and the last line it printed."""
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    lines = (out.stdout + out.stderr).strip().splitlines()
    return out.returncode == 0, lines[-1] if lines else ""


def find_builder(env: Mapping[str, str], which: Callable[[str], str | None] = shutil.which,
                 run: Probe = probe) -> tuple[str | None, list[str]]:
    """The first builder that works (`<tool> info` succeeds: a docker CLI without a daemon does not
    count), and why each one before it did not; CONTAINER_BUILDER names the only one to try."""
    forced = env.get("CONTAINER_BUILDER", "").strip()
    if forced and forced not in BUILDERS:
        raise ImageError(f"CONTAINER_BUILDER={forced}: expected one of {', '.join(BUILDERS)}")
    notes = []
    for name in [forced] if forced else BUILDERS:
        if which(name) is None:
            notes.append(f"{name}: not installed")
            continue
        ok, last = run([name, "info"])
        if ok:
            return name, notes
        notes.append(f"{name}: `{name} info` failed ({last})")
    return None, notes


def sudo() -> list[str]:
    return [] if os.geteuid() == 0 or shutil.which("sudo") is None else ["sudo"]


def apt_install(*packages: str) -> None:
    if shutil.which("apt-get") is None:
        raise ImageError(f"no apt-get to install {' '.join(packages)} with: install it yourself")
    log(f"installing {' '.join(packages)} with apt-get")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run([*sudo(), "apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run([*sudo(), "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
                   check=True, env=env)


def working_builder(env: Mapping[str, str]) -> str:
    name, notes = find_builder(env)
    for note in notes:
        log(note)
    if name is None and not env.get("CONTAINER_BUILDER"):
        apt_install("buildah")
        name, more = find_builder({"CONTAINER_BUILDER": "buildah"})
        notes += more
    if name is None:
        raise ImageError("no working container builder: " + "; ".join(notes))
    log(f"builder: {name}")
    return name


def qualified(image: str) -> str:
    """A name podman and buildah pull without a short-name search list (Docker Hub's spelling)."""
    first = image.split("/", 1)[0]
    if "/" in image and ("." in first or ":" in first or first == "localhost"):
        return image
    return f"docker.io/{image}" if "/" in image else f"docker.io/library/{image}"


@dataclass
class Builder:
    name: str
    isolation: str = "chroot"

    def run(self, *args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess[str]:
        cmd = [self.name, *args]
        if not quiet:
            log("$ " + " ".join(cmd))
        return subprocess.run(cmd, check=check, text=True, capture_output=quiet)

    def exists(self, image: str) -> bool:
        args = {"buildah": ["inspect", "--type", "image", image], "podman": ["image", "exists", image],
                "docker": ["image", "inspect", image]}[self.name]
        return self.run(*args, check=False, quiet=True).returncode == 0

    def pull(self, image: str) -> bool:
        try:
            out = subprocess.run([self.name, "pull", image], capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            return False
        if out.returncode != 0:
            log(f"cannot pull {image}: {(out.stderr.strip().splitlines() or [''])[-1]}")
        return out.returncode == 0

    def import_rootfs(self, tarball: Path, image: str) -> None:
        """A tarball of a root file system as a local image (PATH set, a shell as its command)."""
        path = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        if self.name == "buildah":
            ctr = self.run("from", "scratch", quiet=True).stdout.strip()
            try:
                self.run("add", ctr, str(tarball), "/", quiet=True)
                self.run("config", "--env", path, "--cmd", "/bin/bash", ctr, quiet=True)
                self.run("commit", "--quiet", ctr, image, quiet=True)
            finally:
                self.run("rm", ctr, check=False, quiet=True)
        else:
            self.run("import", "--change", f"ENV {path}", "--change", 'CMD ["/bin/bash"]', str(tarball), image)

    def build_command(self, target: str, names: Sequence[str], build_args: Mapping[str, str]) -> list[str]:
        cmd = [self.name, "bud", "--isolation", self.isolation, "--layers"] if self.name == "buildah" else \
              [self.name, "build"]
        cmd += ["-f", str(DOCKERFILE), "--target", target]
        for name in names:
            cmd += ["-t", name]
        for key, value in build_args.items():
            cmd += ["--build-arg", f"{key}={value}"]
        return [*cmd, str(ROOT)]

    def size(self, image: str) -> int:
        """Bytes of the image's uncompressed layers."""
        if self.name == "buildah":
            info = json.loads(self.run("inspect", "--type", "image", image, quiet=True).stdout)
            manifest = json.loads(info["Manifest"])
            return sum(int(layer["size"]) for layer in manifest["layers"])
        return int(self.run("image", "inspect", "--format", "{{.Size}}", image, quiet=True).stdout.strip())

    def push(self, image: str) -> None:
        self.run("push", image)

    def compressed_size(self, image: str) -> int:
        """Bytes of the image's gzip-compressed layers: what a registry stores and a node pulls."""
        if self.name == "docker":
            proc = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
            assert proc.stdout is not None
            gz, total = zlib.compressobj(6, zlib.DEFLATED, 31), 0
            while chunk := proc.stdout.read(1 << 20):
                total += len(gz.compress(chunk))
            total += len(gz.flush())
            if proc.wait() != 0:
                raise ImageError(f"docker save {image} failed")
            return total
        WORKDIR.mkdir(parents=True, exist_ok=True)
        layout = WORKDIR / "oci-size"
        shutil.rmtree(layout, ignore_errors=True)
        try:
            self.run("push", "--quiet", "--compression-format", "gzip", image, f"oci:{layout}:size", quiet=True)
            index = json.loads((layout / "index.json").read_text())
            digest = index["manifests"][0]["digest"].split(":", 1)[1]
            manifest = json.loads((layout / "blobs" / "sha256" / digest).read_text())
            return sum(int(layer["size"]) for layer in manifest["layers"])
        finally:
            shutil.rmtree(layout, ignore_errors=True)


# --- build inputs --------------------------------------------------------------------------------

def ca_bundle(env: Mapping[str, str], exists: Callable[[str], bool] = os.path.isfile) -> Path | None:
    """The CA bundle pip inside the build should trust: CA_BUNDLE, else the one pip, requests or
    OpenSSL is told to use here, else the system's (a TLS-inspecting proxy's CA is in it)."""
    explicit = env.get("CA_BUNDLE", "").strip()
    if explicit.lower() == "none":
        return None
    if explicit:
        if not exists(explicit):
            raise ImageError(f"CA_BUNDLE={explicit}: no such file")
        return Path(explicit)
    for path in (env.get("PIP_CERT"), env.get("REQUESTS_CA_BUNDLE"), env.get("SSL_CERT_FILE"), *SYSTEM_CA_BUNDLES):
        if path and exists(path):
            return Path(path)
    return None


def reachable(index_url: str, ca: Path | None, timeout: float = 15.0) -> bool:
    """Whether `<index>/torch/` answers (through the CA bundle the build will be given)."""
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    try:
        with urllib.request.urlopen(index_url.rstrip("/") + "/torch/", timeout=timeout, context=context) as r:
            return bool(200 <= int(r.status) < 400)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def pip_find_links(env: Mapping[str, str]) -> list[Path]:
    """The local directories this machine's pip looks in for wheels (find-links, PIP_FIND_LINKS)."""
    values = [env.get("PIP_FIND_LINKS", "")]
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=60).stdout
        values += [m.group(1) for m in re.finditer(r"find-links='([^']*)'", out)]
    except (OSError, subprocess.TimeoutExpired):
        pass
    dirs: list[Path] = []
    for value in values:
        for item in value.split():
            path = Path(item.removeprefix("file://"))
            if path.is_dir() and path not in dirs:
                dirs.append(path)
    return dirs


def torch_wheels(directory: Path, version: str, flavour: str) -> list[Path]:
    """torch `version` wheels in `directory` for this flavour: `+cpu` builds for cpu, any other
    for cuda (PyPI's own Linux wheel is the CUDA build)."""
    found = []
    for wheel in sorted(directory.glob("torch-*.whl")):
        match = re.match(r"torch-([^-+]+)(\+[^-]+)?-", wheel.name)
        if not match or match.group(1) != version:
            continue
        if (match.group(2) == "+cpu") == (flavour == "cpu"):
            found.append(wheel)
    return found


@dataclass
class TorchSource:
    index_url: str
    wheels: list[Path] = field(default_factory=list)  # non-empty: install torch from these, offline

    def describe(self) -> str:
        if self.wheels:
            return "wheels " + ", ".join(str(w) for w in self.wheels if w.name.startswith("torch-"))
        return f"index {self.index_url}"


def torch_source(flavour: str, env: Mapping[str, str], version: str, ca: Path | None,
                 is_reachable: Callable[[str, Path | None], bool] = reachable,
                 find_links: Callable[[Mapping[str, str]], list[Path]] = pip_find_links) -> TorchSource:
    index = env.get("TORCH_INDEX_URL") or TORCH_INDEX[flavour]
    if env.get("TORCH_WHEELS"):
        directory = Path(env["TORCH_WHEELS"])
        if not directory.is_dir():
            raise ImageError(f"TORCH_WHEELS={directory}: not a directory")
        if not torch_wheels(directory, version, flavour):
            kind = "a +cpu build" if flavour == "cpu" else "a CUDA build (no +cpu)"
            raise ImageError(f"TORCH_WHEELS={directory} has no torch {version} wheel of {kind}")
        return TorchSource(index, sorted(directory.glob("*.whl")))
    if is_reachable(index, ca):
        return TorchSource(index)
    for directory in find_links(env):
        wheels = torch_wheels(directory, version, flavour)
        if wheels:
            log(f"{index} is not reachable: torch {version} from pip's find-links ({directory})")
            return TorchSource(index, wheels)
    raise ImageError(f"the torch index {index} is not reachable and no torch {version} {flavour} wheel was found: "
                     "set TORCH_INDEX_URL to an index that works here, or TORCH_WHEELS to a directory of wheels")


def stage_inputs(ca: Path | None, source: TorchSource, inputs: Path = INPUTS) -> None:
    """build/image-inputs: the CA bundle and wheels the build stage copies (never the final image)."""
    shutil.rmtree(inputs, ignore_errors=True)
    inputs.mkdir(parents=True)
    if ca is not None:
        shutil.copyfile(ca, inputs / "ca-certificates.crt")
    if source.wheels:
        (inputs / "wheels").mkdir()
        for wheel in source.wheels:
            try:
                os.link(wheel, inputs / "wheels" / wheel.name)
            except OSError:
                shutil.copyfile(wheel, inputs / "wheels" / wheel.name)


def build_args(flavour: str, base: str, source: TorchSource, version: str, torch_version: str,
               env: Mapping[str, str]) -> dict[str, str]:
    args = {"BASE_IMAGE": base, "IMAGE_VERSION": version, "TORCH_VERSION": torch_version,
            "TORCH_INDEX_URL": source.index_url}
    if source.wheels:
        args["TORCH_FROM_WHEELS"] = "1"
    for name in ("PIP_INDEX_URL", "PIP_NO_INDEX"):
        if env.get(name):
            args[name] = env[name]
    return args


# --- the base image ----------------------------------------------------------------------------

def resolve_base(builder: Builder, env: Mapping[str, str]) -> tuple[str, float]:
    """BASE_IMAGE if it is here or can be pulled; for the default, otherwise a Debian bookworm base
    made with mmdebstrap (the same Python 3.11) and imported under a local name. With the seconds
    spent making it (0 when it was there)."""
    base = env.get("BASE_IMAGE") or DEFAULT_BASE
    name = base if builder.name == "docker" else qualified(base)
    if builder.exists(base):
        return base, 0.0
    if builder.exists(name):
        return name, 0.0
    t0 = time.monotonic()
    if builder.pull(name):
        return name, round(time.monotonic() - t0, 1)
    if env.get("BASE_IMAGE") and base != DEFAULT_BASE:
        raise ImageError(f"BASE_IMAGE={base} is neither here nor pullable")
    local = LOCAL_BASE[builder.name]
    if builder.exists(local):
        log(f"{base} cannot be pulled: using {local} (made earlier with mmdebstrap)")
        return local, 0.0
    log(f"{base} cannot be pulled: making a Debian bookworm base with mmdebstrap as {local}")
    if shutil.which("mmdebstrap") is None:
        apt_install("mmdebstrap")
    WORKDIR.mkdir(parents=True, exist_ok=True)
    tarball = WORKDIR / "base-bookworm.tar"
    t0 = time.monotonic()
    subprocess.run([*sudo(), "mmdebstrap", "--quiet", "--variant=minbase", f"--include={MMDEBSTRAP_PACKAGES}",
                    "bookworm", str(tarball)], check=True)
    builder.import_rootfs(tarball, local)
    tarball.unlink()
    seconds = round(time.monotonic() - t0, 1)
    log(f"{local} made in {seconds:.0f} s")
    return local, seconds


# --- build -------------------------------------------------------------------------------------

@dataclass
class Built:
    flavour: str
    names: list[str]
    base: str
    torch: str
    seconds: float
    size_bytes: int
    base_seconds: float = 0.0  # making or pulling the base, when this build did


def build(flavour: str, env: Mapping[str, str], builder: Builder | None = None) -> Built:
    if flavour not in FLAVOURS:
        raise ImageError(f"unknown flavour {flavour!r}: {' or '.join(FLAVOURS)}")
    builder = builder or Builder(working_builder(env), env.get("BUILDAH_ISOLATION") or "chroot")
    version = chart_version()
    torch_version = env.get("TORCH_VERSION") or dockerfile_arg("TORCH_VERSION")
    ca = ca_bundle(env)
    log(f"CA bundle for pip in the build: {ca or 'none'}")
    source = torch_source(flavour, env, torch_version, ca)
    log(f"torch {torch_version} ({flavour}) from {source.describe()}")
    base, base_seconds = resolve_base(builder, env)
    names = image_names(flavour, env, version)
    stage_inputs(ca, source)
    t0 = time.monotonic()
    try:
        subprocess.run(builder.build_command(flavour, names, build_args(flavour, base, source, version,
                                                                        torch_version, env)), check=True)
    except subprocess.CalledProcessError as exc:
        raise ImageError(f"the {flavour} build failed (exit {exc.returncode})") from None
    finally:
        shutil.rmtree(INPUTS, ignore_errors=True)  # a later plain `docker build .` must not see them
    seconds = time.monotonic() - t0
    size = builder.size(names[0])
    log(f"built {', '.join(names)} in {seconds:.0f} s: {size / 1e9:.2f} GB")
    if env.get("IMAGE_PUSH", "").lower() in ("1", "true", "yes"):
        for name in names:
            builder.push(name)
    return Built(flavour, names, base, source.describe(), round(seconds, 1), size, base_seconds)


# --- test --------------------------------------------------------------------------------------

KERNEL_CHECK = r"""
import json, logging, time
class Compiles(logging.Handler):
    count = 0
    def emit(self, record):
        Compiles.count += record.getMessage().startswith("compiling")
logging.getLogger("chariot").addHandler(Compiles())
logging.getLogger("chariot").setLevel(logging.INFO)
t0 = time.perf_counter()
from chariot.kernels import cpu_build
from chariot.kernels import knobs
problems, loaded, baked, fits = {}, {}, False, None
if hasattr(knobs, "kernel_baseline"):
    baked = any(knobs.kernel_baseline().glob("*/*.so"))
    fits = cpu_build.cpu_flags() >= cpu_build.BASELINE_REQUIRES
if hasattr(cpu_build, "KERNELS"):
    for kernel in cpu_build.KERNELS:
        try:
            cpu_build.load_ops(kernel.source, kernel.stem, kernel.what)
            problems[kernel.stem] = None
        except Exception as exc:
            problems[kernel.stem] = type(exc).__name__ + ": " + (str(exc).strip().splitlines() or [""])[-1]
    loaded = {build.name: build.target for build in getattr(cpu_build, "LOADED", {}).values()}
else:
    from chariot.kernels import cpu_attention, cpu_layer_ops, panel_linear
    for name, module in (("attention", cpu_attention), ("layer_ops", cpu_layer_ops), ("panel_linear", panel_linear)):
        problems[name] = module.build_problem()
print("RESULT " + json.dumps({"seconds": round(time.perf_counter() - t0, 1), "compiled": Compiles.count,
                              "problems": problems, "loaded": loaded, "baseline_in_image": baked,
                              "baseline_fits_cpu": fits}))
"""

CUDA_CHECK = r"""
import json, os, shutil, subprocess, sysconfig
import torch, triton
include = sysconfig.get_paths()["include"]
cc = shutil.which("cc") or shutil.which("gcc")
print("RESULT " + json.dumps({
    "torch": torch.__version__, "torch_cuda": torch.version.cuda, "triton": triton.__version__,
    "cuda_arch_flags": torch._C._cuda_getArchFlags(),
    "cc": subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cc else None,
    "python_h": os.path.isfile(os.path.join(include, "Python.h")),
    "NVIDIA_REQUIRE_CUDA": os.environ.get("NVIDIA_REQUIRE_CUDA")}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Container:
    """A container of `image` to run commands in as the image's user: `buildah from` plus
    `buildah run` (chroot isolation, the host's network), or a docker/podman container on the host
    network kept alive with `sleep` and entered with `exec`."""

    def __init__(self, builder: Builder, image: str, name: str) -> None:
        self.builder, self.image, self.name = builder, image, name

    def __enter__(self) -> Container:
        b = self.builder
        if b.name == "buildah":
            b.run("rm", self.name, check=False, quiet=True)
            b.run("from", "--pull=never", "--name", self.name, self.image, quiet=True)
        else:
            b.run("rm", "-f", self.name, check=False, quiet=True)
            b.run("run", "-d", "--name", self.name, "--network", "host", "--user", USER, "--entrypoint", "sleep",
                  self.image, "infinity", quiet=True)
        return self

    def __exit__(self, *_: object) -> None:
        self.builder.run("rm", *([] if self.builder.name == "buildah" else ["-f"]), self.name, check=False, quiet=True)

    def command(self, script: str) -> list[str]:
        if self.builder.name == "buildah":
            return ["buildah", "run", "--isolation", self.builder.isolation, "--user", USER, self.name, "--",
                    "sh", "-c", script]
        return [self.builder.name, "exec", "--user", USER, self.name, "sh", "-c", script]

    def sh(self, script: str, timeout: float = 900) -> str:
        out = subprocess.run(self.command(script), capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            tail = (out.stdout + out.stderr)[-3000:]
            raise ImageError(f"`{script.strip()[:80]}` exited {out.returncode}:\n{tail}")
        return out.stdout + out.stderr


def result_of(output: str) -> dict[str, Any]:
    line = next((ln for ln in reversed(output.splitlines()) if ln.startswith("RESULT ")), None)
    if line is None:
        raise ImageError(f"no RESULT line in:\n{output[-2000:]}")
    return dict(json.loads(line.removeprefix("RESULT ")))


def http(url: str, body: dict[str, Any]) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


def wait_healthy(base: str, timeout: float = 60.0) -> float:
    """Seconds until the router's readiness (`/health`: a replica is ready) answers 200: `chariot up`
    says it is ready once the router is, which can be a moment before the router routes to a replica."""
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=10) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise ImageError(f"{base}/health did not answer 200 within {timeout:.0f} s")
        time.sleep(0.2)


def completion(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}
    t0 = time.monotonic()
    with urllib.request.urlopen(http(f"{base}/v1/completions", body), timeout=120) as r:
        reply = json.load(r)
    tokens = reply["usage"]["completion_tokens"]
    if tokens < 1 or not reply["choices"]:
        raise ImageError(f"the completion came back empty: {reply}")
    return {"completion_tokens": tokens, "finish_reason": reply["choices"][0]["finish_reason"],
            "seconds": round(time.monotonic() - t0, 2)}


def streamed_chat(base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16,
            "temperature": 0, "stream": True}
    chunks, done, text = 0, False, ""
    t0 = time.monotonic()
    first = None
    with urllib.request.urlopen(http(f"{base}/v1/chat/completions", body), timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line.removeprefix("data:").strip()
            if data == "[DONE]":
                done = True
                break
            for choice in json.loads(data).get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    chunks += 1
                    text += piece
                    first = first if first is not None else time.monotonic() - t0
    if not done or chunks == 0:
        raise ImageError(f"the stream ended without content or [DONE] ({chunks} chunks)")
    return {"content_chunks": chunks, "first_chunk_seconds": round(first or 0.0, 2),
            "seconds": round(time.monotonic() - t0, 2)}


def stop(ctr: Container, proc: subprocess.Popen[str]) -> None:
    """Ctrl-C for `chariot up` (it stops its stages and router), a kill if that takes too long."""
    for signal, wait in (("INT", 90), ("KILL", 30)):
        if proc.poll() is not None:
            return
        try:
            ctr.sh(f"kill -{signal} $(cat /tmp/up.pid)", timeout=60)
            proc.wait(timeout=wait)
        except (ImageError, subprocess.TimeoutExpired) as exc:
            log(f"stopping chariot up with SIG{signal}: {exc}")


def serve_and_query(ctr: Container, model_dir: str, model: str) -> dict[str, Any]:
    """`chariot up --stages 2` inside, a completion and a streamed chat from this (host) process."""
    http_port, grpc_port = free_port(), free_port()
    script = (f"echo $$ > /tmp/up.pid; exec chariot up --model {model_dir} --served-model-name {model} "
              f"--stages 2 --host 127.0.0.1 --http-port {http_port} --grpc-port {grpc_port}")
    WORKDIR.mkdir(parents=True, exist_ok=True)
    log_path = WORKDIR / f"{ctr.name}-up.log"
    lines: list[str] = []
    ready = threading.Event()
    proc = subprocess.Popen(ctr.command(script), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump() -> None:
        assert proc.stdout is not None
        with log_path.open("w") as f:
            for line in proc.stdout:
                f.write(line)
                f.flush()
                lines.append(line)
                if line.startswith("chariot up ready"):
                    ready.set()
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    t0 = time.monotonic()
    try:
        while not ready.wait(1.0):
            if proc.poll() is not None or time.monotonic() - t0 > 900:
                raise ImageError(f"chariot up did not get ready ({log_path}):\n{''.join(lines[-30:])}")
        ready_s = time.monotonic() - t0
        log(f"chariot up ready in {ready_s:.0f} s on 127.0.0.1:{http_port}")
        base = f"http://127.0.0.1:{http_port}"
        healthy_s = wait_healthy(base)
        result = {"ready_seconds": round(ready_s, 1), "healthy_after_ready_seconds": round(healthy_s, 2),
                  "completion": completion(base, model), "streamed_chat": streamed_chat(base, model)}
    finally:
        stop(ctr, proc)
        reader.join(timeout=10)
    result["exit_code"] = proc.returncode
    return result


def check_image(builder: Builder, built: Built) -> dict[str, Any]:
    image = built.names[0]
    checks: dict[str, Any] = {}
    with Container(builder, image, f"chariot-image-test-{built.flavour}") as ctr:
        checks["uid"] = ctr.sh("id -u").strip()
        if checks["uid"] != USER.split(":")[0]:
            raise ImageError(f"commands run as uid {checks['uid']}, not {USER}")
        if "make-model" not in ctr.sh("chariot --help"):
            raise ImageError("`chariot --help` does not list make-model")
        checks["help"] = "ok"
        t0 = time.monotonic()
        ctr.sh("chariot make-model /tmp/model --preset tiny")
        checks["make_model_seconds"] = round(time.monotonic() - t0, 1)
        checks["kernels_first"] = result_of(ctr.sh(f"python -c '{KERNEL_CHECK}'"))
        checks["kernels_again"] = result_of(ctr.sh(f"python -c '{KERNEL_CHECK}'"))
        for key in ("kernels_first", "kernels_again"):
            bad = {k: v for k, v in checks[key]["problems"].items() if v}
            if bad:
                raise ImageError(f"CPU kernels: {bad}")
        if checks["kernels_again"]["compiled"]:
            raise ImageError("the CPU kernels compiled a second time: their cache does not hold")
        first = checks["kernels_first"]
        if first["baseline_in_image"] and first["baseline_fits_cpu"] and first["compiled"]:
            raise ImageError("the image carries the kernels' baseline build, this CPU can run it, yet they compiled")
        if built.flavour == "cuda":
            cuda = result_of(ctr.sh(f"python -c '{CUDA_CHECK}'"))
            if not (cuda["torch_cuda"] and cuda["triton"] and cuda["cc"] and cuda["python_h"]):
                raise ImageError(f"the CUDA image lacks a piece: {cuda}")
            checks["cuda"] = cuda
        checks["serve"] = serve_and_query(ctr, "/tmp/model", "tiny")
        if checks["serve"]["exit_code"] != 0:
            raise ImageError(f"chariot up exited {checks['serve']['exit_code']} on Ctrl-C, not 0")
    return checks


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                      if ln.startswith("model name")), "")
    return {"cpus": os.cpu_count(), "cpu": model, "arch": platform.machine()}


def record(path: Path, builder: str, results: dict[str, Any]) -> None:
    """Merge this test's flavours into `path` (other flavours recorded earlier stay)."""
    data = json.loads(path.read_text()) if path.is_file() else {}
    data.setdefault("images", {}).update(results)
    data.update(date=time.strftime("%Y-%m-%d"), machine=machine(), builder=builder)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    log(f"results written to {path}")


def test(flavours: Iterable[str], env: Mapping[str, str]) -> int:
    builder = Builder(working_builder(env), env.get("BUILDAH_ISOLATION") or "chroot")
    results: dict[str, Any] = {}
    failed = []
    for flavour in flavours:
        built = build(flavour, env, builder)
        entry: dict[str, Any] = {"names": built.names, "base": built.base, "torch": built.torch,
                                 "base_seconds": built.base_seconds, "build_seconds": built.seconds,
                                 "size_bytes": built.size_bytes}
        try:
            entry["compressed_bytes"] = builder.compressed_size(built.names[0])
            log(f"{flavour}: {entry['compressed_bytes'] / 1e9:.2f} GB compressed")
        except (ImageError, subprocess.CalledProcessError, OSError, KeyError) as exc:
            entry["compressed_bytes"] = None
            log(f"{flavour}: the compressed size could not be measured: {exc}")
        try:
            entry["checks"] = check_image(builder, built)
            entry["ok"] = True
        except (ImageError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            entry["ok"], entry["error"] = False, f"{type(exc).__name__}: {exc}"
            failed.append(flavour)
            log(f"{flavour}: FAILED: {exc}")
        results[flavour] = entry
        print(json.dumps({flavour: entry}, indent=2), flush=True)
    if env.get("IMAGE_RECORD"):
        record(Path(env["IMAGE_RECORD"]), builder.name, results)
    for flavour, entry in results.items():
        log(f"{flavour}: {'ok' if entry['ok'] else 'FAILED'}, built in {entry['build_seconds']:.0f} s, "
            f"{entry['size_bytes'] / 1e9:.2f} GB ({(entry['compressed_bytes'] or 0) / 1e9:.2f} GB compressed)")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("builder", help="say which builder a build would use")
    p_build = sub.add_parser("build", help="build one flavour")
    p_build.add_argument("flavour", choices=FLAVOURS)
    p_test = sub.add_parser("test", help="build and check flavours")
    p_test.add_argument("flavours", nargs="*", choices=FLAVOURS, default=["cpu"])
    args = parser.parse_args(argv)
    env = os.environ
    try:
        if args.command == "builder":
            name, notes = find_builder(env)
            for note in notes:
                print(note)
            print(name or "none (a build installs buildah with apt-get)")
            return 0
        if args.command == "build":
            build(args.flavour, env)
            return 0
        return test(args.flavours, env)
    except ImageError as exc:
        log(f"error: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
