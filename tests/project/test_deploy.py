"""Packaging and deployment files: the Dockerfiles lint clean and run the project's own
install recipe, the image's install works in a fresh virtual environment, and the
Kubernetes manifests are valid (schemas, offline), pass checkov's security checks and
agree with the proxy (flags it accepts, config it parses, probes it answers).

No container engine runs here, so no image is built. The fresh-venv test installs
flowlift (``--no-deps``, not editable, as the image does) from exactly the files the
Dockerfile copies; the dependency set itself is what ``scripts/install.sh`` installs
for every developer and CI venv (a full ``pip --dry-run`` resolution of it takes over a
minute here, and a full vLLM install three).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from flowlift import probe
from flowlift.cli import build_parser
from flowlift.proxy.config import UpstreamSpec, parse_config
from flowlift.proxy.state import STATE

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.gpu"]
KUBE = ROOT / "deploy" / "kubernetes"
MANIFESTS = sorted(KUBE.glob("*.yaml"))
BIN = Path(sys.executable).parent


def _instructions(path: Path) -> list[tuple[str, str]]:
    parser = DockerfileParser(fileobj=io.BytesIO(path.read_bytes()))
    return [(i["instruction"], i["value"]) for i in parser.structure
            if i["instruction"] != "COMMENT"]


def _json_list(value: str) -> list[str]:
    return json.loads(value.strip())


def _envs(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for inst, value in _instructions(path):
        if inst == "ENV":
            out.update(part.split("=", 1) for part in shlex.split(value))  # type: ignore[misc]
    return out


def _copied(path: Path) -> list[str]:
    """Sources of the ``COPY`` instructions that copy from the build context."""
    out = []
    for inst, value in _instructions(path):
        if inst == "COPY" and not value.startswith("--from"):
            out += shlex.split(value)[:-1]
    return out


# -- Dockerfiles -------------------------------------------------------------------------


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean(dockerfile):
    proc = subprocess.run([str(BIN / "hadolint"), "--no-color", "--failure-threshold",
                           "style", str(dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_cpu_image_runs_the_shared_install_recipe():
    runs = [v for i, v in _instructions(ROOT / "Dockerfile") if i == "RUN"]
    assert runs[0].startswith("bash scripts/install.sh"), "the image must not grow its own " \
        "install steps: it runs scripts/install.sh"
    install = (ROOT / "scripts" / "install.sh").read_text()
    for name in _envs(ROOT / "Dockerfile"):
        if name.startswith("FLOWLIFT_") and name not in ("FLOWLIFT_CACHE_DIR",
                                                         "FLOWLIFT_PORT"):
            assert name in install, f"install.sh ignores {name}"
    assert "FLOWLIFT_CACHE_DIR" in (ROOT / "local_engine" / "models.py").read_text()
    assert "FLOWLIFT_PORT" in Path(probe.__file__).read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_image_copies_every_package_and_runs_as_non_root(dockerfile):
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    package_dirs = {d.split("/")[0] for d in pyproject["tool"]["setuptools"]["package-dir"]
                    .values()}
    copied = set(_copied(dockerfile))
    assert {"pyproject.toml", "README.md", *package_dirs} <= copied
    assert sum(1 for i, _ in _instructions(dockerfile) if i == "FROM") >= 2  # multi-stage
    user = [v for i, v in _instructions(dockerfile) if i == "USER"][-1]
    assert user.split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_and_healthcheck_are_real_commands(dockerfile):
    inst = dict(_instructions(dockerfile))
    entry = _json_list(inst["ENTRYPOINT"])
    assert entry[:2] == ["flowlift", "serve"]
    args = build_parser().parse_args(entry[1:])  # raises SystemExit on an unknown flag
    assert args.grace_s > 0 and args.state_db.startswith("/var/lib/flowlift/")
    health = _json_list(inst["HEALTHCHECK"].split("CMD", 1)[1])
    assert health[1:3] == ["-m", "flowlift.probe"] and health[3] == "healthz"


def _final_stage_envs(path: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for inst, value in _instructions(path):
        if inst == "FROM":
            out = {}
        elif inst == "ENV":
            out.update(part.split("=", 1) for part in shlex.split(value))  # type: ignore[misc]
    return out


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_engine_caches_are_on_the_writable_volume(dockerfile, monkeypatch):
    """The model cache (FLOWLIFT_CACHE_DIR) is read-only at run time: every cache the
    engine would put under it must be set to the state volume by the image."""
    from flowlift.local_engine.vllm_engine import VLLMConfig, set_env_defaults

    env = _final_stage_envs(dockerfile)
    cache = env["FLOWLIFT_CACHE_DIR"]
    monkeypatch.setattr(os, "environ", {"FLOWLIFT_CACHE_DIR": cache})
    set_env_defaults(VLLMConfig(model="/models/m", served_model_name="m"))
    derived = {k for k, v in os.environ.items() if v.startswith(cache + "/")}
    assert derived, "set_env_defaults no longer derives caches from FLOWLIFT_CACHE_DIR?"
    for key in derived:
        assert env.get(key, "").startswith("/var/lib/flowlift/"), \
            f"{dockerfile.name}: {key} would be under the read-only {cache}"


def test_gpu_image_is_the_official_vllm_build_pyproject_asks_for():
    from packaging.requirements import Requirement

    image = next(v for i, v in _instructions(ROOT / "Dockerfile.gpu") if i == "ARG"
                 and v.startswith("VLLM_IMAGE="))
    tag = image.split(":", 1)[1].lstrip("v")
    cuda = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["cuda"]
    [vllm] = [Requirement(r) for r in cuda if Requirement(r).name == "vllm"]
    assert image.startswith("VLLM_IMAGE=vllm/vllm-openai:")
    # pinned both ways to the versions checked (docs/gpu.md), and the image inside it
    assert any(s.operator == "<" for s in vllm.specifier), vllm
    assert vllm.specifier.contains(tag), (tag, str(vllm.specifier))
    # the image build fails when its vLLM is outside the pin (a VLLM_IMAGE build arg)
    runs = " ".join(v for i, v in _instructions(ROOT / "Dockerfile.gpu") if i == "RUN")
    assert "python3 -m flowlift.local_engine.vllm_pin" in runs


def test_the_image_install_works_in_a_fresh_venv(tmp_path):
    """What the image's install does to flowlift itself, from the files it copies."""
    ctx = tmp_path / "context"
    for src in _copied(ROOT / "Dockerfile"):
        (ctx / src).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / src).is_dir():
            shutil.copytree(ROOT / src, ctx / src,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / src, ctx / src)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check", "-qq"]
    proc = subprocess.run([*pip, "install", "--no-deps", "."], cwd=ctx, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (venv / "bin" / "flowlift").is_file()
    site = next((venv / "lib").glob("python3*/site-packages"))
    installed = {p.relative_to(site / "flowlift").as_posix()
                 for p in (site / "flowlift").rglob("*.py")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    expected = set()
    for package, folder in pyproject["tool"]["setuptools"]["package-dir"].items():
        prefix = package.removeprefix("flowlift").strip(".").replace(".", "/")
        # every module, subpackages' too (tests/test_layers.py: pyproject lists them all)
        expected |= {f"{prefix}/{p.relative_to(ROOT / folder).as_posix()}".lstrip("/")
                     for p in (ROOT / folder).rglob("*.py")}
    assert expected <= installed, sorted(expected - installed)
    # the probe needs only the standard library: it runs in the bare venv
    proc = subprocess.run([str(venv / "bin" / "python"), str(site / "flowlift" / "probe.py"),
                           "readyz", "--url", "http://127.0.0.1:9"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no answer from http://127.0.0.1:9" in proc.stderr


# -- the probe ---------------------------------------------------------------------------


async def test_probe_reports_ready_and_why_not(client):
    base = str(client.make_url("")).rstrip("/")
    assert await asyncio.to_thread(probe.check, f"{base}/healthz", 2) is None
    assert await asyncio.to_thread(probe.check, f"{base}/readyz", 2) is None
    client.app[STATE].ready.clear()
    why = await asyncio.to_thread(probe.check, f"{base}/readyz", 2)
    assert why == "HTTP 503: the engine is still loading"


# -- Kubernetes ----------------------------------------------------------------------------


def _docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]


def test_manifests_validate_against_the_kubernetes_schemas():
    assert len(MANIFESTS) >= 3
    for path, doc in _docs():
        try:
            kubernetes_validate.validate(doc, "1.33.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{path.name} {doc['kind']}/{doc['metadata']['name']}: {exc.message}")


def test_manifests_pass_checkov_offline():
    checkov = ROOT / ".venv-checkov" / "bin" / "checkov"
    assert checkov.is_file(), "run `bash scripts/install.sh --test` (checkov has its own venv)"
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_RUN_SCA_PACKAGE_SCAN_V2": "false"}
    env.pop("BC_API_KEY", None)
    proc = subprocess.run([str(checkov), "--config-file", str(ROOT / "deploy" / "checkov.yaml"),
                           "-d", str(KUBE), "--output", "json"], capture_output=True,
                          text=True, env=env, timeout=300)
    report = json.loads(proc.stdout)
    failed = report["results"]["failed_checks"]
    assert proc.returncode == 0 and not failed, [(f["check_id"], f["resource"]) for f in failed]
    assert report["summary"]["passed"] > 100


def _pod_specs() -> list[tuple[str, dict]]:
    return [(d["metadata"]["name"], d["spec"]["template"]["spec"]) for _, d in _docs()
            if d["kind"] in ("Deployment", "StatefulSet")]


def test_every_container_is_locked_down_probed_and_sized():
    for name, pod in _pod_specs():
        assert pod["automountServiceAccountToken"] is False, name
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        for c in pod.get("initContainers", []) + pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
            assert {"readinessProbe", "livenessProbe"} <= set(c), (name, c["name"])
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), (name, c["name"])


def _flowlift_sidecars() -> list[tuple[str, dict, dict]]:
    return [(name, pod, c) for name, pod in _pod_specs() for c in pod.get("initContainers", [])
            if c["name"] == "flowlift"]


def test_sidecars_bind_loopback_probe_by_exec_and_outlive_the_grace_period():
    sidecars = _flowlift_sidecars()  # the gateway is no sidecar: it serves the cluster
    assert len(sidecars) == 3
    entry = _json_list(dict(_instructions(ROOT / "Dockerfile"))["ENTRYPOINT"])
    for name, pod, c in sidecars:
        assert c["restartPolicy"] == "Always", name  # a native sidecar
        args = build_parser().parse_args(entry[1:] + c["args"])
        assert args.host == "127.0.0.1", name
        for probe_name in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = c[probe_name]["exec"]["command"]  # httpGet cannot reach loopback
            assert command[:3] == ["python", "-m", "flowlift.probe"], (name, probe_name)
        assert pod["terminationGracePeriodSeconds"] > args.grace_s, name


def _doc(kind: str, name: str) -> dict:
    return next(d for _, d in _docs() if d["kind"] == kind and d["metadata"]["name"] == name)


def _engine_args() -> list[str]:
    return _doc("StatefulSet", "flowlift-engine")["spec"]["template"]["spec"][
        "containers"][0]["args"]


def test_config_maps_are_configs_the_proxy_accepts(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k")
    monkeypatch.setenv("FLOWLIFT_API_KEYS", "k")
    configs = {d["metadata"]["name"]: d["data"]["flowlift.toml"] for _, d in _docs()
               if d["kind"] == "ConfigMap"}
    assert len(configs) == 4
    parsed = {name: parse_config(tomllib.loads(text), source=name)
              for name, text in configs.items()}
    # the pool configs name each replica of the engine StatefulSet by its stable DNS name
    sts = _doc("StatefulSet", "flowlift-engine")
    svc, ns = sts["spec"]["serviceName"], sts["metadata"]["namespace"]
    port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    served = next(a.split("=", 1)[1] for a in _engine_args()
                  if a.startswith("--served-model-name="))
    for name in ("flowlift-pool-config", "flowlift-gateway-config"):
        pool = parsed[name]
        ups = [b for b in pool.backends.values() if isinstance(b, UpstreamSpec)]
        assert sorted(b.base_url for b in ups) == [
            f"http://{sts['metadata']['name']}-{i}.{svc}.{ns}.svc:{port}/v1"
            for i in range(sts["spec"]["replicas"])], name
        assert pool.models[served].backends == sorted(pool.backends), name
        # the hint orders requests only where the server schedules by priority
        assert all(b.hints == ["vllm-priority"] for b in ups), name
    assert "--scheduling-policy=priority" in _engine_args()


def test_the_gateway_runs_replicas_on_one_database_behind_a_service():
    gateway = _doc("Deployment", "flowlift-gateway")
    assert gateway["spec"]["replicas"] >= 2
    pod = gateway["spec"]["template"]["spec"]
    proxy = pod["containers"][0]
    env = {e["name"]: e for e in proxy["env"]}
    entry = _json_list(dict(_instructions(ROOT / "Dockerfile"))["ENTRYPOINT"])
    # Kubernetes expands $(VAR) in args from the container's env: the URL is a Secret's
    args = build_parser().parse_args(entry[1:] + [
        a.replace("$(FLOWLIFT_STATE_DB)", "postgresql://u:p@db/flowlift")
        for a in proxy["args"]])
    assert args.state_db == "postgresql://u:p@db/flowlift"
    assert "$(FLOWLIFT_STATE_DB)" in proxy["args"]
    assert env["FLOWLIFT_STATE_DB"]["valueFrom"]["secretKeyRef"]["key"] == "url"
    assert args.host == "0.0.0.0" and args.engine == "none" and args.lease_ttl_s > 0
    assert pod["terminationGracePeriodSeconds"] > args.grace_s
    for probe_name, path in (("startupProbe", "/readyz"), ("readinessProbe", "/readyz"),
                             ("livenessProbe", "/healthz")):
        assert proxy[probe_name]["httpGet"]["path"] == path, probe_name
    # the Service reaches the replicas on the port the proxy listens on
    service = _doc("Service", "flowlift-gateway")
    labels = gateway["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == proxy["ports"][0]["name"]
    assert proxy["ports"][0]["containerPort"] == args.port
    # the engines admit the gateway (flowlift.dev/proxy) and so does the database
    for policy in ("flowlift-engine", "flowlift-postgres"):
        allowed = _doc("NetworkPolicy", policy)["spec"]["ingress"][0]["from"][0][
            "podSelector"]["matchLabels"]
        assert allowed.items() <= labels.items(), policy
    # the bundled database is the one the Secret's example URL names
    postgres = _doc("StatefulSet", "flowlift-postgres")
    pg_env = {e["name"]: e.get("value") for e in
              postgres["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert pg_env["POSTGRES_USER"] == pg_env["POSTGRES_DB"] == "flowlift"
    assert postgres["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"][
        "storage"]


def test_the_router_sidecar_hands_vllm_router_its_session_and_program(monkeypatch):
    """sidecar-router.yaml: flowlift sidecars send to one vllm-router Service, which
    routes among the engine pool's replicas by session with program scheduling on
    (docs/distributed.md; the router itself is tested in tests/proxy/test_router_vllm.py)."""
    monkeypatch.setenv("VLLM_API_KEY", "k")
    text = _doc("ConfigMap", "flowlift-router-config")["data"]["flowlift.toml"]
    config = parse_config(tomllib.loads(text), source="flowlift-router-config")
    [fleet] = [b for b in config.backends.values() if isinstance(b, UpstreamSpec)]
    assert fleet.hints == ["vllm-session", "vllm-router-program"]
    router = _doc("Deployment", "vllm-router")
    service = _doc("Service", "vllm-router")
    meta = router["metadata"]
    assert fleet.base_url == (f"http://{service['metadata']['name']}.{meta['namespace']}"
                              f".svc:{service['spec']['ports'][0]['port']}/v1")
    args = router["spec"]["template"]["spec"]["containers"][0]["args"]
    assert {"--policy=consistent_hash", "--enable-program-scheduling"} <= set(args)
    workers = args[args.index("--worker-urls") + 1:]
    sts = _doc("StatefulSet", "flowlift-engine")
    assert workers == [f"http://{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"
                       f".{sts['metadata']['namespace']}.svc:8000"
                       for i in range(sts["spec"]["replicas"])]
    # the router reaches the engines (their policy admits flowlift.dev/proxy) and only
    # the router-client pods reach the router
    assert router["spec"]["template"]["metadata"]["labels"]["flowlift.dev/proxy"] == "true"
    allowed = _doc("NetworkPolicy", "vllm-router")["spec"]["ingress"][0]["from"][0][
        "podSelector"]["matchLabels"]
    app = _doc("Deployment", "my-router-app")["spec"]["template"]["metadata"]["labels"]
    assert allowed.items() <= app.items()
