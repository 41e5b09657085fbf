"""Static checks of what cannot run here (no Docker engine, no cluster): the images, compose file and
manifests must parse, pass their linters, and run exactly the commands `libra up` runs natively."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from services.common.credentials import kind_of
from tools.stack import service_commands

ROOT = Path(__file__).resolve().parents[2]
NATIVE = {("python", "-m", module) for _, module in service_commands(1)}


def _bin(name: str) -> str:
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} is a dev dependency and should be installed")
    return found


def _services(compose: dict) -> dict[str, dict]:
    """The Libra service containers (not the one-shot credentials and job containers)."""
    return {n: s for n, s in compose["services"].items() if "build" in s and n not in ("credentials", "job")}


def _libra_run(argv: list[str]):
    """`argv` (a container's `libra run …`) as the real CLI parses it."""
    from tools.cli import cmd_run, parse, parser

    assert argv[:2] == ["libra", "run"], argv
    args = parse(parser(), argv[1:])
    assert args.fn is cmd_run
    return args


def test_compose_runs_native_commands_for_every_service() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = _services(compose)
    assert {tuple(s["command"]) for s in services.values()} == NATIVE
    for name, svc in services.items():
        env = svc["environment"]
        assert env["LIBRA_NATS_URL"].startswith("tls://") and env["LIBRA_OTLP_ENDPOINT"], name
        assert env["LIBRA_REDIS_URL"].startswith("rediss://") and env["LIBRA_TLS_CA_FILE"], name
        assert "LIBRA_CONFIG" not in env and "LIBRA_RUN_ID" not in env, name  # idle, as under `libra up`
    assert "jaeger" in compose["services"]


def test_compose_submits_jobs_with_libra_run() -> None:
    """`docker compose run --rm job [CONFIG] [overrides]` is `libra run` against the stack's own
    NATS and Redis, with the cli identity's credentials, writing where the trainer checkpoints."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    job, trainer = compose["services"]["job"], compose["services"]["trainer"]
    assert job["profiles"] == ["job"] and str(job["user"]) == "10001"
    command = [c.replace("${LIBRA_RUN_CONFIG:-gpu.yaml}", "gpu.yaml") for c in job["command"]]
    args = _libra_run(job["entrypoint"] + command + ["--training.steps", "3"])
    assert args.nats_url == trainer["environment"]["LIBRA_NATS_URL"]
    assert args.redis_url == trainer["environment"]["LIBRA_REDIS_URL"]
    assert args.overrides == ["training.steps=3"] and args.config == "/app/configs/gpu.yaml"
    mounts = dict(v.rsplit(":", 2)[:2] if v.count(":") == 2 else v.split(":", 1) for v in job["volumes"])
    assert mounts["./.libra/compose-secrets/cli"] == f"{args.secrets}/cli"
    assert mounts["runs"] == args.output_dir and "runs:/app/runs" in trainer["volumes"]
    assert set(job["depends_on"]) == set(_services(compose))


def test_compose_gives_every_gpu_service_its_own_gpu_and_every_service_a_healthcheck() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = _services(compose)
    devices = {}
    for name, svc in services.items():
        reserved = svc.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices", [])
        for d in reserved:
            assert "count" not in d and len(d["device_ids"]) == 1, name  # one named GPU, not "any one"
            devices[name] = d["device_ids"][0]
        port = svc["environment"]["LIBRA_METRICS_PORT"]
        probe = " ".join(svc["healthcheck"]["test"])
        assert f"http://127.0.0.1:{port}/metrics" in probe, name
    assert set(devices) == {"rollout-engine-0", "rollout-engine-1", "trainer"}
    assert len(set(devices.values())) == len(devices)  # no two services on one GPU
    default = re.search(r"\$\{LIBRA_RUN_CONFIG:-([\w.]+)\}", compose["services"]["job"]["command"][0])
    assert default is not None
    gpu = yaml.safe_load((ROOT / "configs" / default.group(1)).read_text())
    assert gpu["rollout"]["backend"] == "vllm"  # vLLM serves in compose


def test_compose_is_secure_by_default() -> None:
    """Credentials generated once by `libra credentials`, each service mounting only its own; the
    servers use them; nothing published beyond loopback."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert services["credentials"]["command"][:2] == ["libra", "credentials"]
    sandbox = [v.split(":")[0] for v in services["tool-sandbox"]["volumes"]]
    assert sandbox == ["./configs", "./.libra/compose-secrets/tool-sandbox", "./task"], (
        "no shared writable volume"
    )
    assert all(v.endswith(":ro") for v in services["tool-sandbox"]["volumes"])
    # an identity per worker: exactly the workers compose runs
    cmd = services["credentials"]["command"]
    workers = set(cmd[cmd.index("--workers") + 1].split(","))
    assert workers == set(_services(compose)), workers
    assert "-c" in services["nats"]["command"] and "/secrets/redis.conf" in services["redis"]["command"]
    assert "-m" not in services["nats"]["command"], "NATS's monitoring port has no authentication"
    for name, svc in services.items():  # no service may start without credentials
        assert "LIBRA_INSECURE" not in (svc.get("environment") or {}), name
        assert "--insecure" not in (svc.get("command") or []), name
    for name, svc in services.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
        if name == "job":
            assert [v for v in svc["volumes"] if "compose-secrets" in v] == [
                "./.libra/compose-secrets/cli:/run/secrets/libra/cli:ro"
            ]
        elif "build" in svc and name != "credentials":
            secrets = [v for v in svc["volumes"] if "compose-secrets" in v]
            assert secrets == [f"./.libra/compose-secrets/{name}:/run/secrets/libra:ro"], name
            assert svc["environment"]["LIBRA_SECRETS_DIR"] == "/run/secrets/libra"
            assert svc["depends_on"]["credentials"]["condition"] == "service_completed_successfully"


def test_k8s_manifests_validate_and_run_native_commands() -> None:
    files = sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
    out = subprocess.run(
        [_bin("kubernetes-validate"), "-k", "1.30.0", *map(str, files)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout + out.stderr
    commands = set()
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc and doc["kind"] in ("Deployment", "StatefulSet"):
                for c in doc["spec"]["template"]["spec"]["containers"]:
                    if "command" in c:
                        commands.add(tuple(c["command"]))
    assert commands == NATIVE


def test_the_k8s_job_is_libra_run_against_the_stack() -> None:
    docs = [
        d
        for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    (job,) = [d for d in docs if d["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = _libra_run(c["command"] + c["args"])
    trainer = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "trainer")
    tpod = trainer["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in tpod["containers"][0]["env"]}
    assert (args.nats_url, args.redis_url) == (env["LIBRA_NATS_URL"], env["LIBRA_REDIS_URL"])
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "libra"
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[mounts[f"{args.secrets}/cli"]]["secret"]["secretName"] == "libra-cli-credentials"
    # the report and the export need the trainer's checkpoints: the same claim, on the same node
    tvolumes = {v["name"]: v for v in tpod["volumes"]}
    tmounts = {m["mountPath"]: m["name"] for m in tpod["containers"][0]["volumeMounts"]}
    claim = volumes[mounts[args.output_dir]]["persistentVolumeClaim"]["claimName"]
    assert claim == tvolumes[tmounts[args.output_dir]]["persistentVolumeClaim"]["claimName"]
    (term,) = pod["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["labelSelector"]["matchLabels"] == trainer["spec"]["selector"]["matchLabels"]
    data = yaml.safe_load((ROOT / "deploy" / "k8s" / "01-run-config.yaml").read_text())["data"]
    assert args.config.removeprefix("/app/configs/") in data


def test_k8s_mounts_per_service_secrets_behind_a_network_policy() -> None:
    docs = [
        d
        for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    assert policies["default-deny-ingress"] == {"podSelector": {}, "policyTypes": ["Ingress"]}
    workloads = {
        d["metadata"]["name"]: d["spec"]["template"]["spec"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["namespace"] == "libra"
    }
    # the collector every pod sends its traces to is there (a namespace of its own)
    jaeger = {
        (d["kind"], d["metadata"]["name"]) for d in docs if d["metadata"].get("namespace") == "observability"
    }
    assert {("Deployment", "jaeger"), ("Service", "jaeger-collector")} <= jaeger
    for name, pod in workloads.items():
        secrets = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
        if name in ("nats", "redis"):
            assert secrets == {f"libra-{name}-config"}, name
            continue
        assert secrets == {f"libra-{kind_of(name)}-credentials"}, name
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["LIBRA_SECRETS_DIR"] == "/run/secrets/libra", name
        # mutual TLS under the stack's CA, with the files `libra credentials --tls` puts in the Secret
        assert env["LIBRA_NATS_URL"].startswith("tls://") and env["LIBRA_REDIS_URL"].startswith("rediss://")
        for var, file in (("CA", "ca.pem"), ("CERT", "cert.pem"), ("KEY", "key.pem")):
            assert env[f"LIBRA_TLS_{var}_FILE"] == f"/run/secrets/libra/{file}", name


def test_generated_k8s_secrets_are_the_ones_the_manifests_mount(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.cli",
            "credentials",
            str(tmp_path / "c"),
            "--tls",
            "--k8s-namespace",
            "libra",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    (tmp_path / "secrets.yaml").write_text(out.stdout)
    check = subprocess.run(
        [_bin("kubernetes-validate"), "-k", "1.30.0", str(tmp_path / "secrets.yaml")],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    names = {d["metadata"]["name"] for d in yaml.safe_load_all(out.stdout)}
    mounted = {
        v["secret"]["secretName"]
        for f in (ROOT / "deploy" / "k8s").glob("*.yaml")
        for d in yaml.safe_load_all(f.read_text())
        if d and d["kind"] in ("Deployment", "StatefulSet", "Job")
        for v in d["spec"]["template"]["spec"].get("volumes", [])
        if "secret" in v
    }
    assert mounted <= names
    # every file a manifest names in a Secret's mount is in that Secret
    data = {d["metadata"]["name"]: set(d["stringData"]) for d in yaml.safe_load_all(out.stdout)}
    for f in (ROOT / "deploy" / "k8s").glob("1*.yaml"):
        for d in yaml.safe_load_all(f.read_text()):
            if not d or d["kind"] not in ("Deployment", "StatefulSet"):
                continue
            pod = d["spec"]["template"]["spec"]
            if d["metadata"]["namespace"] != "libra":
                continue
            secret = next(v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v)
            mount = next(
                m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "config"
            )
            named = {a.rsplit("/", 1)[1] for a in pod["containers"][0]["args"] if a.startswith(mount + "/")}
            assert named and named <= data[secret], (f.name, named - data[secret])
    planner = data["libra-planner-credentials"]
    assert {"ca.pem", "cert.pem", "key.pem"} <= planner


def test_dockerfiles_pass_hadolint() -> None:
    files = sorted((ROOT / "deploy" / "docker").glob("Dockerfile*"))
    out = subprocess.run([_bin("hadolint"), *map(str, files)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    for _, module in service_commands(1):
        assert f'CMD ["python", "-m", "{module}"]' in text


def test_k8s_config_map_is_generated_from_configs_and_pods_have_probes() -> None:
    from tools.k8s_config import OUT, config_map

    assert OUT.read_text() == config_map(), "deploy/k8s/01-run-config.yaml is stale: run `make docs`"
    pods = 0
    for f in sorted((ROOT / "deploy" / "k8s").glob("2*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            spec = doc["spec"]["template"]["spec"]
            for c in spec["containers"]:
                pods += 1
                env = {e["name"]: e.get("value") for e in c["env"]}
                assert "LIBRA_CONFIG" not in env and "LIBRA_RUN_ID" not in env, f.name  # idle until a job
                port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
                assert str(port) == env["LIBRA_METRICS_PORT"], f.name
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, (f.name, probe)
                mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
                writable = {v["name"]: v for v in spec["volumes"]}
                for path in ("/app/.libra", "/app/runs"):  # written by uid 10001
                    if path in mounts:
                        assert (
                            "configMap" not in writable[mounts[path]]
                            and "secret" not in writable[mounts[path]]
                        )
    assert pods == 5
    trainer = [d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "24-trainer.yaml").read_text()) if d]
    claims = [d for d in trainer if d["kind"] == "PersistentVolumeClaim"]
    assert claims, "the trainer's checkpoints need a persistent volume"


def test_engines_reach_the_trainers_hybrid_rendezvous_in_compose_and_k8s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The trainer's settings, read from each deployment's environment by the trainer's own
    settings class, listen on every interface at a fixed port and announce a name the engines
    resolve (the compose service, the k8s headless Service); k8s lets the group's ranks connect."""
    from services.trainer.config import TrainerSettings

    def settings(env: dict[str, str]) -> TrainerSettings:
        for key in [k for k in os.environ if k.startswith("LIBRA_TRAINER_")]:
            monkeypatch.delenv(key)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return TrainerSettings()

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    s = settings({k: str(v) for k, v in compose["services"]["trainer"]["environment"].items()})
    assert (s.hybrid_host, s.hybrid_port, s.hybrid_advertise_host) == ("0.0.0.0", 29500, "trainer")
    assert "rollout-engine-0" in compose["services"] and "networks" not in compose["services"]["trainer"]

    docs = [
        d
        for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]
    (trainer,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "trainer"]
    container = trainer["spec"]["template"]["spec"]["containers"][0]
    s = settings({e["name"]: e["value"] for e in container["env"] if "value" in e})
    assert (s.hybrid_host, s.hybrid_port) == ("0.0.0.0", 29500)
    assert {"name": "hybrid", "containerPort": s.hybrid_port} in container["ports"]
    (svc,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == "trainer"]
    assert s.hybrid_advertise_host == f"trainer.{svc['metadata']['namespace']}.svc"
    assert svc["spec"]["selector"] == trainer["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"] == [{"name": "hybrid", "port": s.hybrid_port}]

    def admits(policy: dict, labels: dict[str, str]) -> bool:
        sel = policy["podSelector"]
        return all(labels.get(k) == v for k, v in sel.get("matchLabels", {}).items()) and all(
            labels.get(e["key"]) in e["values"] for e in sel.get("matchExpressions", [])
        )

    policies = [d["spec"] for d in docs if d["kind"] == "NetworkPolicy"]
    pods = {
        n: {"app.kubernetes.io/name": n, "app.kubernetes.io/part-of": "libra"}
        for n in ("trainer", "rollout-engine")
    }
    for dst, src in (
        ("trainer", "rollout-engine"),
        ("rollout-engine", "trainer"),
        ("rollout-engine", "rollout-engine"),
    ):
        # some policy selecting the destination admits the source on every port (gloo's pairs)
        assert any(
            admits(p, pods[dst])
            and any(
                "ports" not in rule and any(admits(peer, pods[src]) for peer in rule.get("from", []))
                for rule in p.get("ingress", [])
            )
            for p in policies
        ), (src, dst)


def test_k8s_engines_announce_a_name_other_pods_resolve_and_their_certificate_names(tmp_path: Path) -> None:
    from cryptography import x509

    from services.common.credentials import generate

    docs = [
        d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "23-rollout-engine.yaml").read_text()) if d
    ]
    sts = next(d for d in docs if d["kind"] == "StatefulSet")
    svc = next(d for d in docs if d["kind"] == "Service")
    assert svc["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == svc["metadata"]["name"]
    env = {e["name"]: e.get("value") for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    host = env["LIBRA_ROLLOUT_ENGINE_ADVERTISE_HOST"].replace("$(LIBRA_WORKER_ID)", "rollout-engine-0")
    ns = sts["metadata"]["namespace"]
    assert host == f"rollout-engine-0.{svc['metadata']['name']}.{ns}.svc"  # pod.headless-service.ns.svc
    creds = generate(tmp_path / "c", tls_namespace=ns)
    cert = x509.load_pem_x509_certificate((creds.identity_dir("rollout-engine") / "cert.pem").read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "*." + host.split(".", 1)[1] in names.get_values_for_type(x509.DNSName)


def test_k8s_redis_keeps_its_data_and_the_sandbox_may_make_namespaces() -> None:
    """Fencing counters and commit records outlive a rescheduled Redis pod (a claim, not emptyDir);
    the sandbox's bubblewrap is not denied by AppArmor's default profile (compose has the same)."""
    redis_ = next(d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "11-redis.yaml").read_text()) if d)
    assert redis_["kind"] == "StatefulSet"
    claims = {c["metadata"]["name"] for c in redis_["spec"]["volumeClaimTemplates"]}
    mounts = {
        m["mountPath"]: m["name"] for m in redis_["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    }
    assert mounts["/data"] in claims
    assert "--appendonly" in redis_["spec"]["template"]["spec"]["containers"][0]["args"]
    sandbox = next(
        d for d in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "22-tool-sandbox.yaml").read_text()) if d
    )
    ctx = sandbox["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    assert ctx["appArmorProfile"]["type"] == "Unconfined" and ctx["seccompProfile"]["type"] == "Unconfined"
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert "apparmor=unconfined" in compose["services"]["tool-sandbox"]["security_opt"]


def test_the_images_give_uid_10001_a_home_and_carry_the_shipped_examples() -> None:
    for name in ("Dockerfile", "Dockerfile.gpu"):
        text = (ROOT / "deploy" / "docker" / name).read_text()
        assert "--create-home --home-dir /home/libra" in text and "HOME=/home/libra" in text, name
        assert "COPY examples ./examples" in text, name
    gpu = (ROOT / "deploy" / "docker" / "Dockerfile.gpu").read_text()
    assert "python3 -m pip install" in gpu and 'ln -s "$(command -v python3)" /usr/local/bin/python' in gpu


def test_a_task_of_your_own_is_one_read_only_directory_for_every_container_that_reads_it() -> None:
    """./task, mounted at /app/task into the containers that load a user's dataset, reward,
    environment or tool plugins (the schedulers, the sandbox) and the job (`libra run` checks
    them before it starts): one place, the same path everywhere."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    having = {n for n, s in compose["services"].items() if "./task:/app/task:ro" in s.get("volumes", [])}
    assert having == {"scheduler", "scheduler-standby", "tool-sandbox", "job"}
    # Kubernetes: the libra-task ConfigMap (optional: a shipped config needs none) at the same path
    k8s = set()
    for f in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(f.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet", "Job"):
                continue
            spec = doc["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in spec.get("volumes", [])}
            for c in spec["containers"]:
                for m in c.get("volumeMounts", []):
                    if m["mountPath"] == "/app/task":
                        assert m["readOnly"] is True, f.name
                        assert volumes[m["name"]]["configMap"] == {"name": "libra-task", "optional": True}
                        k8s.add(doc["metadata"]["labels"]["app.kubernetes.io/name"])
    assert k8s == {"scheduler", "tool-sandbox", "job"}
