"""The container image build (.ci/images.py, the Dockerfile, `make image*`, skaffold) without building.

Builds take minutes and gigabytes, so `make image-test` is opt-in (docs/images.md); what is checked
here is what decides a build before it starts: which builder is picked (a docker CLI without a
daemon is not a builder), where torch comes from (an index, a wheel directory, pip's find-links when
the index is unreachable), the CA bundle, the staged inputs the Dockerfile copies, and that the tags
`make image` gives, the Helm chart's default image, the operator's default image and skaffold's
builds agree.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chariot_images_script", ROOT / ".ci" / "images.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


images = load_script()


# --- the builder -------------------------------------------------------------------------------

def fake_machine(installed: set[str], working: set[str]) -> tuple[Callable[[str], str | None],
                                                                  Callable[[Sequence[str]], tuple[bool, str]]]:
    def which(name: str) -> str | None:
        return f"/usr/bin/{name}" if name in installed else None

    def probe(cmd: Sequence[str]) -> tuple[bool, str]:
        assert list(cmd[1:]) == ["info"], "a builder works when `<tool> info` does (docker: the daemon answers)"
        return (cmd[0] in working, "" if cmd[0] in working else "Cannot connect to the Docker daemon")
    return which, probe


@pytest.mark.parametrize(("installed", "working", "expected"), [
    ({"docker", "podman", "buildah"}, {"docker", "podman", "buildah"}, "docker"),
    ({"docker", "buildah"}, {"buildah"}, "buildah"),  # a docker CLI with no daemon is skipped
    ({"docker", "podman"}, {"podman"}, "podman"),
    ({"podman", "buildah"}, {"podman", "buildah"}, "podman"),
    ({"docker"}, set(), None),  # none works: the build installs buildah
    (set(), set(), None),
])
def test_the_first_working_builder_is_picked(installed: set[str], working: set[str], expected: str | None) -> None:
    which, probe = fake_machine(installed, working)
    name, notes = images.find_builder({}, which=which, run=probe)
    assert name == expected
    assert len(notes) == (images.BUILDERS.index(expected) if expected else len(images.BUILDERS))
    if "docker" in installed and "docker" not in working:
        assert "docker: `docker info` failed" in notes[0]


def test_a_named_builder_is_the_only_one_tried() -> None:
    which, probe = fake_machine({"docker", "buildah"}, {"docker", "buildah"})
    assert images.find_builder({"CONTAINER_BUILDER": "buildah"}, which=which, run=probe)[0] == "buildah"
    name, notes = images.find_builder({"CONTAINER_BUILDER": "podman"}, which=which, run=probe)
    assert name is None and notes == ["podman: not installed"]
    with pytest.raises(images.ImageError, match="CONTAINER_BUILDER=kaniko"):
        images.find_builder({"CONTAINER_BUILDER": "kaniko"}, which=which, run=probe)


def test_build_commands_per_builder() -> None:
    args = {"BASE_IMAGE": "b", "TORCH_VERSION": "2.13.0"}
    buildah = images.Builder("buildah").build_command("cpu", ["r:1-cpu"], args)
    assert buildah[:5] == ["buildah", "bud", "--isolation", "chroot", "--layers"]  # no OCI runtime needed
    docker = images.Builder("docker").build_command("cuda", ["r:1-cuda", "r:1"], args)
    assert docker[:2] == ["docker", "build"] and "--isolation" not in docker
    for cmd, target in ((buildah, "cpu"), (docker, "cuda")):
        assert cmd[cmd.index("--target") + 1] == target and cmd[-1] == str(ROOT)
        assert "--build-arg" in cmd and "BASE_IMAGE=b" in cmd and "TORCH_VERSION=2.13.0" in cmd
    assert docker.count("-t") == 2


def test_short_names_are_qualified_for_podman_and_buildah() -> None:
    assert images.qualified("python:3.11-slim") == "docker.io/library/python:3.11-slim"
    assert images.qualified("someone/python:3.11") == "docker.io/someone/python:3.11"
    for name in ("localhost/chariot-base:bookworm", "registry.example.com/py:3", "host:5000/py:3"):
        assert images.qualified(name) == name


# --- torch, CA bundle, staged inputs -----------------------------------------------------------

def wheel_dir(tmp_path: Path, *names: str) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for name in names:
        (tmp_path / name).write_bytes(b"wheel")
    return tmp_path


CPU_WHEEL = "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
CUDA_WHEEL = "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl"


def test_torch_comes_from_the_index_when_it_answers() -> None:
    source = images.torch_source("cpu", {}, "2.13.0", None, is_reachable=lambda url, ca: True,
                                 find_links=lambda env: pytest.fail("no fallback needed"))
    assert source.index_url == "https://download.pytorch.org/whl/cpu" and source.wheels == []
    cuda = images.torch_source("cuda", {}, "2.13.0", None, is_reachable=lambda url, ca: True)
    assert cuda.index_url == "https://pypi.org/simple"  # PyPI's Linux torch wheel is the CUDA build
    mirror = images.torch_source("cpu", {"TORCH_INDEX_URL": "https://mirror/simple"}, "2.13.0", None,
                                 is_reachable=lambda url, ca: url == "https://mirror/simple")
    assert mirror.index_url == "https://mirror/simple"


def test_an_unreachable_index_falls_back_to_pips_find_links(tmp_path: Path) -> None:
    links = wheel_dir(tmp_path / "links", CPU_WHEEL, "torch-2.12.0+cpu-cp311-cp311-linux_x86_64.whl", "numpy-2.0.whl")
    source = images.torch_source("cpu", {}, "2.13.0", None, is_reachable=lambda url, ca: False,
                                 find_links=lambda env: [tmp_path / "empty", links])
    assert [w.name for w in source.wheels] == [CPU_WHEEL]  # only torch, only this version
    with pytest.raises(images.ImageError, match="not reachable"):  # no CUDA wheel there
        images.torch_source("cuda", {}, "2.13.0", None, is_reachable=lambda url, ca: False,
                            find_links=lambda env: [links])


def test_a_wheel_directory_is_used_whole_and_must_hold_the_flavours_torch(tmp_path: Path) -> None:
    offline = wheel_dir(tmp_path / "wheels", CPU_WHEEL, "numpy-2.0-cp311-cp311-linux_x86_64.whl")
    source = images.torch_source("cpu", {"TORCH_WHEELS": str(offline)}, "2.13.0", None,
                                 is_reachable=lambda url, ca: pytest.fail("a wheel directory needs no index"))
    assert sorted(w.name for w in source.wheels) == sorted([CPU_WHEEL, "numpy-2.0-cp311-cp311-linux_x86_64.whl"])
    with pytest.raises(images.ImageError, match="CUDA build"):
        images.torch_source("cuda", {"TORCH_WHEELS": str(offline)}, "2.13.0", None)
    with pytest.raises(images.ImageError, match=r"no torch 2\.14\.0"):
        images.torch_source("cpu", {"TORCH_WHEELS": str(offline)}, "2.14.0", None)
    cuda = wheel_dir(tmp_path / "cuda", CUDA_WHEEL)
    assert images.torch_source("cuda", {"TORCH_WHEELS": str(cuda)}, "2.13.0", None).wheels
    with pytest.raises(images.ImageError, match="not a directory"):
        images.torch_source("cpu", {"TORCH_WHEELS": str(tmp_path / "nowhere")}, "2.13.0", None)


def test_the_ca_bundle_is_the_systems_unless_told(tmp_path: Path) -> None:
    system = images.SYSTEM_CA_BUNDLES[0]
    assert images.ca_bundle({}, exists=lambda p: p == system) == Path(system)
    assert images.ca_bundle({}, exists=lambda p: False) is None
    assert images.ca_bundle({"CA_BUNDLE": "none"}, exists=lambda p: True) is None
    assert images.ca_bundle({"PIP_CERT": "/x/pip.pem"}, exists=lambda p: True) == Path("/x/pip.pem")
    own = tmp_path / "proxy.pem"
    own.write_text("cert")
    assert images.ca_bundle({"CA_BUNDLE": str(own), "PIP_CERT": "/x"}) == own
    with pytest.raises(images.ImageError, match="no such file"):
        images.ca_bundle({"CA_BUNDLE": str(tmp_path / "missing.pem")})


def test_staged_inputs_hold_the_ca_bundle_and_wheels(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("cert")
    wheels = wheel_dir(tmp_path / "w", CPU_WHEEL)
    inputs = tmp_path / "build" / "image-inputs"
    (inputs / "stale").mkdir(parents=True)
    images.stage_inputs(ca, images.TorchSource("idx", sorted(wheels.glob("*.whl"))), inputs)
    assert sorted(p.name for p in inputs.iterdir()) == ["ca-certificates.crt", "wheels"]
    assert [p.name for p in (inputs / "wheels").iterdir()] == [CPU_WHEEL]
    args = images.build_args("cpu", "base", images.TorchSource("idx", [wheels / CPU_WHEEL]), "0.1.0", "2.13.0", {})
    assert args["TORCH_FROM_WHEELS"] == "1"
    images.stage_inputs(None, images.TorchSource("idx"), inputs)
    assert list(inputs.iterdir()) == []
    assert "TORCH_FROM_WHEELS" not in images.build_args("cpu", "b", images.TorchSource("idx"), "0.1.0", "2.13.0", {})


# --- the Dockerfile, the Makefile, skaffold and the chart agree ---------------------------------

def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def declared_args(text: str) -> set[str]:
    return set(re.findall(r"^ARG (\w+)", text, re.M))


def test_every_build_arg_the_script_passes_is_declared() -> None:
    source = images.TorchSource("idx", [Path("w.whl")])
    env = {"PIP_INDEX_URL": "https://mirror", "PIP_NO_INDEX": "1"}
    passed = images.build_args("cuda", "b", source, "0.1.0", "2.13.0", env)
    assert {"PIP_INDEX_URL", "PIP_NO_INDEX", "TORCH_FROM_WHEELS"} <= set(passed)
    assert set(passed) <= declared_args(dockerfile())


def test_dockerfile_targets_and_user() -> None:
    text = dockerfile()
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, re.M)
    assert {"build", "runtime", "cpu", "cuda"} <= set(stages)
    assert stages[-1] == "cpu", "a plain build (no --target) gives the CPU image its default index matches"
    assert "ARG BASE_IMAGE=python:3.11-slim" in text
    assert re.search(r"^USER 10001:10001", text, re.M)
    cuda = text.split("AS cuda", 1)[1].split("\nFROM ", 1)[0]
    assert 'NVIDIA_REQUIRE_CUDA="cuda>=${CUDA_MAJOR}.0"' in cuda and "ARG CUDA_MAJOR=13" in cuda
    assert 'nvidia-driver-min="580"' in cuda  # CUDA 13.x needs an NVIDIA driver >= 580
    # the staged inputs reach the build stage, optionally: a glob that may match nothing, next to a
    # file that always exists; .dockerignore lets build/image-inputs in while keeping build/ out
    assert "COPY pyproject.toml build/image-input[s] /tmp/inputs/" in text
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore.index("!build/image-inputs") > ignore.index("build")
    assert images.INPUTS == ROOT / "build" / "image-inputs"


def test_versions_agree() -> None:
    """The chart's appVersion (its default image tag) is the package's version and the Dockerfile's;
    the torch the image installs is the one `make install` pins."""
    version = images.chart_version()
    assert re.search(rf'^version = "{re.escape(version)}"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert images.dockerfile_arg("IMAGE_VERSION") == version
    torch = images.dockerfile_arg("TORCH_VERSION")
    assert f'pip install --quiet "torch=={torch}"' in (ROOT / "Makefile").read_text()


def test_make_image_gives_the_charts_and_the_operators_default_image() -> None:
    from chariot.operator.controller import DEFAULT_IMAGE

    values = yaml.safe_load((ROOT / "charts" / "chariot" / "values.yaml").read_text())
    assert values["image"]["tag"] == "", "the chart's tag defaults to its appVersion"
    chart_default = f"{values['image']['repository']}:{images.chart_version()}"
    cuda, cpu = images.image_names("cuda", {}), images.image_names("cpu", {})
    assert chart_default in cuda and chart_default == DEFAULT_IMAGE
    assert cpu == [f"{chart_default}-cpu"] and f"{chart_default}-cuda" in cuda
    assert images.image_names("cpu", {"IMAGE_REPO": "reg.example/c"}) == [f"reg.example/c:{images.chart_version()}-cpu"]
    assert images.image_names("cuda", {"IMAGE_NAMES": "reg/x:abc"}) == ["reg/x:abc"]


def make_rules() -> dict[str, str]:
    """target -> its prerequisites and recipe, as written."""
    rules: dict[str, str] = {}
    for match in re.finditer(r"^([\w $()%-]+?):(?!=)(.*(?:\n\t.*)*)", (ROOT / "Makefile").read_text(), re.M):
        for target in match.group(1).split():
            rules[target] = match.group(2)
    return rules


def test_make_targets_call_the_script_and_stay_out_of_make_test() -> None:
    rules = make_rules()
    assert rules["image"].split() == ["image-cuda"]
    assert "$(IMAGES) build $(@:image-%=%)" in rules["image-cuda"] and rules["image-cpu"] == rules["image-cuda"]
    assert "$(IMAGES) test $(IMAGE_FLAVOURS)" in rules["image-test"]
    assert "IMAGES := $(PYTHON) .ci/images.py" in (ROOT / "Makefile").read_text()
    assert not re.search(r"\bimage", rules["test"].split("\n")[0]), "image builds are opt-in"


def test_skaffold_builds_with_the_make_targets() -> None:
    config = yaml.safe_load((ROOT / "skaffold.yaml").read_text())
    (artifact,) = config["build"]["artifacts"]
    values = yaml.safe_load((ROOT / "charts" / "chariot" / "values.yaml").read_text())
    assert artifact["image"] == values["image"]["repository"]
    command = artifact["custom"]["buildCommand"]
    assert command == 'make image-cpu IMAGE_NAMES="$IMAGE" IMAGE_PUSH="$PUSH_IMAGE"'  # skaffold's name and push
    assert artifact["custom"]["dependencies"]["dockerfile"]["path"] == "Dockerfile"
    (gpu,) = [p for p in config["profiles"] if p["name"] == "gpu"]
    assert gpu["patches"] == [{"op": "replace", "path": "/build/artifacts/0/custom/buildCommand",
                               "value": command.replace("image-cpu", "image-cuda")}]
    rules = make_rules()
    assert {"image-cpu", "image-cuda"} <= set(rules)
