"""Every Libra container of deploy/k8s started as its pod would start it, without a cluster
(tests/deploy_rig.py): the Secrets `libra credentials --tls --k8s-namespace libra` prints (an
identity per service kind), materialised as the kubelet does (each file with the volume's mode,
the pod's `fsGroup` as its group), the ConfigMap, emptyDir and claim volumes at their mount
paths, every env entry as the kubelet resolves it (`$(VAR)` references, the pod's name), NATS and
Redis with their manifests' arguments and probes. Each pod comes up as its worker (the pod's name)
over mutual TLS, then the Job's `libra run` command runs a tiny job on them, writing to the
trainer's claim. What differs from a pod: tests/deploy_rig.py (and DNS: an engine announces
`localhost`, after the test checks its certificate names the address the manifest announces)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from services.common.credentials import StackCredentials, generate, k8s_secrets, kind_of
from services.common.localstack import Server, start_redis
from services.common.runconfig import ModelConfig
from tests.deploy_rig import (
    K8S_DIR,
    ROOT,
    UID,
    Nats,
    Workers,
    certifies,
    idle_workers,
    local_environment,
    map_paths,
    readable_as,
    scheduler_roles,
    start_nats_as,
    tls_flags,
)

pytestmark = pytest.mark.integration

DOCS = [d for f in sorted(K8S_DIR.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
WORKLOADS = {d["metadata"]["name"]: d for d in DOCS if d["kind"] in ("Deployment", "StatefulSet", "Job")}
CONFIG_MAPS = {d["metadata"]["name"]: d["data"] for d in DOCS if d["kind"] == "ConfigMap"}
SERVICES = {
    n: d
    for n, d in WORKLOADS.items()
    if n in ("planner", "scheduler", "tool-sandbox", "rollout-engine", "trainer")
}


def pod_names(name: str, workload: dict[str, Any]) -> list[str]:
    """A StatefulSet's pods are <name>-<i>; a Deployment's <name>-<replicaset hash>-<suffix>."""
    n = workload["spec"].get("replicas", 1)
    if workload["kind"] == "StatefulSet":
        return [f"{name}-{i}" for i in range(n)]
    return [f"{name}-5d8f7c9b6-{s}" for s in ("x2k4p", "q9w7m", "b3n8t")[:n]]


def pod_env(container: dict[str, Any], pod: str) -> dict[str, str]:
    """The container's environment as the kubelet resolves it: `$(VAR)` from entries before it,
    `fieldRef: metadata.name` the pod's name; anything else is not something this test knows."""
    env: dict[str, str] = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(
                r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), str(e["value"])
            )
        else:
            assert e["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}, e
            env[e["name"]] = pod
    return env


@dataclass
class Cluster:
    """Volumes as the kubelet would mount them, under one directory uid 10001 may walk."""

    base: Path
    secrets: dict[str, dict[str, str]]

    def volume(self, pod: str, spec: dict[str, Any], fs_group: int | None) -> Path:
        name = spec["name"]
        if "secret" in spec:
            files = self.secrets.get(spec["secret"]["secretName"])
            assert files is not None, f"{pod}: no Secret {spec['secret']['secretName']} is generated"
            d = self.base / "volumes" / pod / name
            d.mkdir(parents=True, exist_ok=True)
            for fname, text in files.items():
                (d / fname).write_text(text)
                os.chmod(d / fname, spec["secret"].get("defaultMode", 0o644))
                if fs_group is not None and os.geteuid() == 0:
                    os.chown(d / fname, 0, fs_group)
            return d
        if "configMap" in spec:
            data = CONFIG_MAPS.get(spec["configMap"]["name"])
            if data is None:
                assert spec["configMap"].get("optional"), f"{pod}: no ConfigMap {spec['configMap']['name']}"
                data = {}
            d = self.base / "volumes" / pod / name
            d.mkdir(parents=True, exist_ok=True)
            for fname, text in data.items():
                (d / fname).write_text(text)
            return d
        if "persistentVolumeClaim" in spec:  # shared by every pod that claims it
            d = self.base / "claims" / spec["persistentVolumeClaim"]["claimName"]
        else:
            assert "emptyDir" in spec, spec
            d = self.base / "volumes" / pod / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pod(self, pod: str, workload: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Path]]:
        """The pod's one container and its mounts (container path → directory here); the rest of
        its filesystem (`/app`, its working directory, and the like) a directory of its own."""
        spec = workload["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        fs_group = spec.get("securityContext", {}).get("fsGroup")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for claim in workload["spec"].get("volumeClaimTemplates", []):  # a StatefulSet's own claims
            tname = claim["metadata"]["name"]
            volumes[tname] = {"name": tname, "persistentVolumeClaim": {"claimName": f"{tname}-{pod}"}}
        root = self.base / "pods" / pod
        mounts = {}
        for m in container["volumeMounts"]:  # the volume at its path in the pod's filesystem
            at = root / m["mountPath"].lstrip("/")
            at.parent.mkdir(parents=True, exist_ok=True)
            if not at.is_symlink():
                at.symlink_to(self.volume(pod, volumes[m["name"]], fs_group), target_is_directory=True)
            mounts[m["mountPath"]] = at
        for top in ("/app", "/run", "/etc", "/data"):
            mounts.setdefault(top, root / top[1:])
            mounts[top].mkdir(parents=True, exist_ok=True)
        return container, mounts


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o711)  # uid 10001 may walk to the volumes, as to a kubelet's
        creds = generate(Path(tmp) / "credentials", tls_namespace="libra")
        secrets: dict[str, dict[str, str]] = {}
        for secret in k8s_secrets(creds, "libra"):
            meta, data = secret["metadata"], secret["stringData"]
            assert isinstance(meta, dict) and isinstance(data, dict)
            secrets[meta["name"]] = data
        shutil.rmtree(creds.root)  # a pod sees only what its Secrets hold
        yield Cluster(Path(tmp) / "cluster", secrets)


@pytest.fixture(scope="module")
def servers(cluster: Cluster) -> Iterator[tuple[Nats, Server]]:
    logs = cluster.base / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    nc, nats_mounts = cluster.pod("nats-0", WORKLOADS["nats"])
    nats = start_nats_as(nc["args"], nats_mounts, cluster.base / "nats-data", logs / "nats.log")
    rc, redis_mounts = cluster.pod("redis-0", WORKLOADS["redis"])
    assert rc["args"][0] == "valkey-server" and rc["args"][1].endswith("/redis.conf")
    conf = Path(map_paths(rc["args"][1], redis_mounts))
    redis_server = start_redis(cluster.base / "redis-data", logs / "redis.log", config=conf)
    yield nats, redis_server
    nats.server.stop()
    redis_server.stop()


def test_nats_and_redis_answer_their_probes(cluster: Cluster, servers: tuple[Nats, Server]) -> None:
    nats, redis_server = servers
    (c,) = WORKLOADS["nats"]["spec"]["template"]["spec"]["containers"]
    for probe in ("readinessProbe", "livenessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[0] == "wget" and nats.health(command[-1]) == 200, probe
    rc, mounts = cluster.pod("redis-0", WORKLOADS["redis"])
    for probe in ("readinessProbe", "livenessProbe"):
        sh, flag, line = rc[probe]["exec"]["command"]
        assert (
            (sh, flag) == ("sh", "-c")
            and line.startswith("valkey-cli --tls")
            and line.endswith("| grep -q PONG")
        )
        argv = line.split()
        for option in ("--cacert", "--cert", "--key"):  # files of the Secret it mounts
            assert Path(map_paths(argv[argv.index(option) + 1], mounts)).is_file(), (probe, option)
        user, password = argv[argv.index("--user") + 1], argv[argv.index("--pass") + 1]
        assert redis.Redis.from_url(redis_server.url, username=user, password=password).ping() is True


@pytest.mark.skipif(os.geteuid() != 0, reason="reads files as another uid: needs root")
def test_each_pod_reads_its_secrets_as_uid_10001(cluster: Cluster) -> None:
    for name, workload in {**SERVICES, "libra-job": WORKLOADS["libra-job"]}.items():
        c, mounts = cluster.pod(pod_names(name, workload)[0], workload)
        pod_spec = workload["spec"]["template"]["spec"]
        assert c["securityContext"].get("runAsUser", UID) == UID, name  # else the image's USER 10001
        assert pod_spec["securityContext"]["fsGroup"] == UID, name
        secret_mounts = [m["mountPath"] for m in c["volumeMounts"] if m["name"] == "credentials"]
        assert secret_mounts, name
        for path in secret_mounts:
            for f in mounts[path].iterdir():
                assert readable_as(UID, UID, f), (name, f.name)


def test_every_k8s_service_starts_as_its_pod_and_the_job_runs_on_them(
    cluster: Cluster, servers: tuple[Nats, Server], tiny_model: ModelConfig
) -> None:
    nats, redis_server = servers
    logs = cluster.base / "logs"
    workers = Workers(logs)
    pods: dict[str, str] = {}
    try:
        for name, workload in SERVICES.items():
            for pod in pod_names(name, workload):
                c, mounts = cluster.pod(pod, workload)
                resolved = pod_env(c, pod)
                env = local_environment(resolved, mounts, nats, redis_server)
                if name == "rollout-engine":  # announced under the headless Service: its certificate names it
                    host = resolved["LIBRA_ROLLOUT_ENGINE_ADVERTISE_HOST"]
                    assert host == f"{pod}.{workload['spec']['serviceName']}.libra.svc", host
                    assert certifies(Path(env["LIBRA_TLS_CERT_FILE"]), host), host
                    env["LIBRA_ROLLOUT_ENGINE_ADVERTISE_HOST"] = "localhost"  # no cluster DNS here
                workers.start(pod, c["command"], env, mounts["/app"])
                pods[pod] = kind_of(pod)
        jc, mounts = cluster.pod("libra-job-7x2kq", WORKLOADS["libra-job"])
        cli_tls = tls_flags(jc["command"], mounts)
        creds = StackCredentials(mounts["/run/secrets/libra/cli"].parent)
        found = idle_workers(cli_tls, creds, nats.url, pods, workers)
        assert jc["command"][:2] == ["libra", "run"] and jc["args"] == ["/app/configs/gpu.yaml"]
        argv = [map_paths(a, mounts) for a in jc["command"][2:]]
        argv[argv.index("--nats-url") + 1] = nats.url
        argv[argv.index("--redis-url") + 1] = redis_server.url
        tiny = map_paths("/app/configs/tiny.yaml", mounts)
        env = {k: v for k, v in os.environ.items() if not k.startswith("LIBRA_")}
        env.update({e["name"]: str(e["value"]) for e in jc["env"]}, PYTHONPATH=str(ROOT))
        done = subprocess.run(
            [sys.executable, "-m", "tools.cli", "run", *argv, "--run-id", "k8s-tiny", tiny]
            + ["--training.steps", "2", "--model.cache_dir", str(tiny_model.cache_dir)],
            cwd=mounts["/app"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        workers.stop()
    for pod, kind in pods.items():  # each pod speaks as its worker (its name), of its kind
        assert found[pod].state == "idle" and found[pod].service == kind, (pod, found[pod])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report_path = mounts["/app/runs"] / "k8s-tiny" / "report.json"
    assert report_path.is_file(), "the report goes to the trainer's claim"
    report = yaml.safe_load(report_path.read_text())
    assert report["status"] == "completed", report["reason"]
    assert report["train_steps"] == 2 and report["all_engines_on_final_version"], report["engines"]
    assert report["trajectories_lost"] == 0 and report["trajectories_trained_twice"] == 0
    # the scheduler's two replicas: the planner gave one the job, the other stood by, warm
    schedulers = [p for p, kind in pods.items() if kind == "scheduler"]
    assert len(schedulers) == 2 and scheduler_roles(logs, schedulers) == ["leading", "standing_by"]
