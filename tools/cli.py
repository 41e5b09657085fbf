"""The `libra` command: up, down, status, run, report, export, trace, config check, credentials, sim,
sandbox, bench."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import ConfigFileError
from tools.run_dirs import add_output_dir
from tools.stack import Stack, pid_alive, read_stack_file, stack_file, stack_files

if TYPE_CHECKING:
    from services.common.runconfig import RunConfig

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
"""The configs shipped with Libra (configs/ of the repository, tools/configs in the package)."""
DEFAULT_CONFIG = "default.yaml"


def shipped_configs() -> list[str]:
    return sorted(p.name for p in CONFIG_DIR.glob("*.yaml"))


def config_path(config: str) -> Path:
    """A run config by path or, when no such file exists, a shipped config by name (`gpu`,
    `gpu.yaml` or `configs/gpu.yaml`), so an installed Libra runs its examples from anywhere."""
    path = Path(config)
    if path.is_file():
        return path
    name = path.name if path.name.endswith((".yaml", ".yml")) else f"{path.name}.yaml"
    if str(path.parent) in (".", "configs") and (CONFIG_DIR / name).is_file():
        return CONFIG_DIR / name
    raise ConfigFileError(
        f"run config not found: {config} (shipped configs, usable by name: {', '.join(shipped_configs())})"
    )


def _load(config: str, overrides: list[str] | None = None) -> tuple[Path, object]:
    from services.common.runconfig import load_run_config

    path = config_path(config)
    return path, load_run_config(path, overrides or [])


def config_overrides(extra: list[str]) -> list[str]:
    """`--training.lr 1e-6`, `--training.lr=1e-6` or `training.lr=1e-6` → `training.lr=1e-6`;
    ValueError for anything else."""
    out: list[str] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            if "=" in arg:
                out.append(arg[2:])
            elif i + 1 < len(extra):
                out.append(f"{arg[2:]}={extra[i + 1]}")
                i += 1
            else:
                raise ValueError(f"{arg} needs a value (e.g. {arg} 3)")
        elif not arg.startswith("-") and "=" in arg and "." in arg.split("=", 1)[0]:
            out.append(arg)
        else:
            raise ValueError(f"unrecognized argument {arg!r} (config overrides look like --training.lr 1e-6)")
        i += 1
    return out


def stack_engines(cfg: RunConfig) -> int:
    """Engines a stack for this config starts: the job's, or, where the job searches its layout
    as it starts, the chosen layout's (the same search, deterministic, so the job then finds them)."""
    if not cfg.planner.layout.search:
        return cfg.engines_needed
    from tools.layout import choose_layout, summary

    chosen, decision = choose_layout(cfg)
    print(summary(decision), file=sys.stderr)
    return chosen.engines_needed


def cmd_up(args: argparse.Namespace) -> int:
    """Starts an idle stack sized by the config (engines) and supervises it until Ctrl-C / `libra down`."""
    from services.common.runconfig import RunConfig

    if up := read_stack_file():
        print(
            f"a stack is already up ({up['stack_file']}); jobs started here run on it. `libra down` "
            "first, or start the new one outside its directory",
            file=sys.stderr,
        )
        return 1
    path, cfg = _load(args.config_option or args.config)
    assert isinstance(cfg, RunConfig)
    from services.common.models import resolve_model_dir

    resolve_model_dir(cfg.model)  # converted once here, so the first job starts quickly
    engines = args.engines or stack_engines(cfg)
    name = args.name or f"stack-{time.strftime('%Y%m%d-%H%M%S')}"
    stack = Stack(
        name, Path("runs").resolve() / name / "logs", args.otlp_endpoint, max_restarts=args.max_restarts
    )
    stopping = {"flag": False}

    def on_signal(signum: int, _: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        stack.start_infra(engines, args.standby_trainers, args.standby_schedulers)
        stack.start_services()
        state_file = stack_file()
        state_file.parent.mkdir(parents=True, exist_ok=True)
        state_file.write_text(json.dumps(stack.state(), indent=2))
        print(f"Libra stack {name} up, idle: submit jobs with `libra run CONFIG`")
        print(f"  nats   {stack.nats_url}\n  redis  {stack.redis_url}\n  logs   {stack.log_dir}")
        print(f"  credentials  {stack.credentials.root if stack.credentials else 'none'} (mode 0700)")
        for svc, p in stack.procs.items():
            print(f"  {svc:<18} pid {p.pid:<8} metrics http://127.0.0.1:{stack.metrics_ports[svc]}/metrics")
        print(f"state in {state_file}; Ctrl-C or `libra down` stops everything.", flush=True)
        while not stopping["flag"]:
            time.sleep(0.5)
            restarted = stack.supervise()
            for svc in restarted:
                n = stack.restarts[svc]
                print(f"service {svc} died; restarted ({n}/{stack.max_restarts})", file=sys.stderr)
            if restarted:
                state_file.write_text(json.dumps(stack.state(), indent=2))
            for svc, code in stack.dead().items():
                print(
                    f"service {svc} exited with code {code} and is not restarted again; stopping the stack",
                    file=sys.stderr,
                )
                stopping["flag"] = True
                break
    finally:
        print("stopping the stack…", file=sys.stderr)
        stack.stop()
        stack_file().unlink(missing_ok=True)
    return 0


def cmd_down(_: argparse.Namespace) -> int:
    # the nearest stack file, its supervisor alive or not (killed hard: its services are cleaned up)
    state_file = next((f for f in stack_files() if f.is_file()), None)
    data = json.loads(state_file.read_text()) if state_file is not None else None
    if state_file is None or not data:
        print("no stack is up")
        return 0
    sup = int(data.get("supervisor_pid", 0))
    if sup and pid_alive(sup):
        os.kill(sup, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while pid_alive(sup) and time.monotonic() < deadline:
            time.sleep(0.2)
    for pid in [*data.get("services", {}).values(), *data.get("infra", {}).values()]:
        if pid_alive(int(pid)):  # the supervisor was killed hard: clean up after it
            os.kill(int(pid), signal.SIGKILL)
    state_file.unlink(missing_ok=True)
    print(f"stack {data.get('name', '')} stopped ({state_file})")
    return 0


def cmd_status(_: argparse.Namespace) -> int:
    data = read_stack_file()
    if not data:
        print("no stack is up")
        return 1
    print(f"stack {data['name']}  nats {data['nats_url']}  redis {data['redis_url']}  ({data['stack_file']})")
    print(f"  credentials {data.get('secrets') or 'none'}")
    procs: dict[str, int] = {**data["services"], **data["infra"]}  # type: ignore[dict-item]
    restarts: dict[str, int] = data.get("restarts") or {}  # type: ignore[assignment]
    metrics: dict[str, int] = data.get("metrics_ports") or {}  # type: ignore[assignment]
    for name, pid in procs.items():
        state = "running" if pid_alive(int(pid)) else "exited"
        where = f"  metrics http://127.0.0.1:{metrics[name]}/metrics" if name in metrics else ""
        print(f"  {name:<18} pid {pid:<8} {state:<8} restarts {restarts.get(name, 0)}{where}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from services.common.errors import CredentialsRefused
    from services.common.runconfig import RunConfig
    from tools.runner import run_job

    path, cfg = _load(args.config, args.overrides)
    assert isinstance(cfg, RunConfig)
    stack = None
    if args.nats_url or args.redis_url:
        if not (args.nats_url and args.redis_url):
            raise ConfigFileError("a remote stack needs both --nats-url and --redis-url")
        try:
            secrets = Path(args.secrets) if args.secrets else None
            tls = _tls_files(args)
            stack = Stack.reached_at(
                args.nats_url, args.redis_url, secrets, Path(args.output_dir).resolve(), tls
            )
        except (FileNotFoundError, ValueError) as e:
            raise ConfigFileError(str(e)) from None
        if args.embedded:
            raise ConfigFileError("--embedded starts a stack here: not with --nats-url/--redis-url")
    elif args.secrets or args.tls_ca_file:
        raise ConfigFileError("--secrets and --tls-ca-file are for a remote stack (--nats-url, --redis-url)")
    try:
        report = run_job(
            path,
            cfg,
            run_id=args.run_id,
            runs_dir=Path(args.output_dir),
            timeout_s=args.timeout,
            otlp_endpoint=args.otlp_endpoint,
            max_restarts=args.max_restarts,
            stack=stack,
            embedded=args.embedded,
        )
    except CredentialsRefused as e:
        if stack is None:
            raise
        print(
            f"the stack at {stack.nats_url} refused the CLI ({e.code}): pass its credentials with "
            "--secrets DIR (the cli/ directory `libra credentials DIR` wrote in it)",
            file=sys.stderr,
        )
        return 2
    return print_summary(report)


def _tls_files(args: argparse.Namespace) -> Any:
    """The CA (and client certificate) a remote stack's NATS and WeightSync are verified with."""
    from services.common.tls import TlsFiles

    files = {
        name: getattr(args, f"tls_{name}_file") or os.environ.get(f"LIBRA_TLS_{name.upper()}_FILE")
        for name in ("ca", "cert", "key")
    }
    if not (files["ca"] or files["cert"]):
        return None
    return TlsFiles(files["ca"], files["cert"], files["key"])


def print_summary(report: dict[str, Any]) -> int:
    """The run's summary as `libra run` ends with it; exit code 0 only for a completed run with
    every serving engine on the final version."""
    keys = ["status", "rollout_backend", "wall_s", "trajectories_completed", "trajectories_per_s"]
    keys += ["train_steps", "final_weight_version"]
    print("\n".join(f"{k:<24} {report.get(k)}" for k in keys))
    if report.get("reward"):
        print(f"{'reward':<24} {report['reward']}")
    print(f"{'reward_mean_per_step':<24} {report.get('reward_mean_per_step')}")
    for k in ("reward_first3", "reward_last3"):
        if (w := report.get(k)) is not None:
            print(
                f"{k:<24} {w['mean']} (95% CI {w['ci95'][0]} .. {w['ci95'][1]}, {w['trajectories']} trajectories)"
            )
    for r in report.get("eval") or []:
        if "version" in r:
            ci = f" (95% CI {r['ci95'][0]} .. {r['ci95'][1]})" if r.get("ci95") else ""
            lost = f", failed {r['failed']}" if r.get("failed") else ""
            n = r.get("samples_per_prompt", 1)
            on = f"{r['completed']}/{r['prompts']} held-out prompts"
            if n > 1:
                on = f"{r['completed']}/{r.get('trajectories')} samples of {r['prompts']} held-out prompts"
            passes = "".join(f", pass@{k} {v}" for k, v in (r.get("pass_at_k") or {}).items() if n > 1)
            print(f"{'eval v' + str(r['version']):<24} {r['reward_mean']}{ci} on {on}{passes}{lost}")
    versions = [v if v else "–" for v in report.get("policy_versions_per_step") or []]
    print(f"{'policy_versions_per_step':<24} {', '.join(map(str, versions)) or '–'}")
    mismatch = report.get("logprob_mismatch_per_step") or []
    shown = ", ".join("–" if m is None else f"{m:.1e}" for m in mismatch) or "–"
    why = (
        " (–: no token of that step's batch was sampled at the trainer's weights)" if None in mismatch else ""
    )
    print(f"{'logprob_mismatch':<24} {shown}{why}")
    print(f"{'tool_calls':<24} {report.get('tool_calls')}")
    if (samples := report.get("samples")) and samples.get("trajectories"):
        print(
            f"{'samples':<24} {samples['trajectories']} trajectories in {samples['path']} (`libra samples`)"
        )
    if layout := report.get("layout"):
        gain = layout.get("predicted_gain")
        over = f", predicted {gain:+.1%} over the config's" if gain is not None else ""
        print(f"{'layout':<24} {layout['chosen']} ({layout['engines']} engines{over})")
    if failed := report.get("trajectories_failed_by_code"):
        print(f"{'trajectories_failed':<24} {failed}")
    invalid = report.get("invalid_turn_results") or {}
    if invalid.get("by_engine"):
        out = f", quarantined {invalid['quarantined']}" if invalid.get("quarantined") else ""
        print(f"{'invalid_turn_results':<24} {invalid['by_engine']}{out}")
    refused = report.get("refused") or {}  # what the stack refused an identity (docs/security.md)
    if said := {what: by for what in ("weight_pushes", "redis", "nats") if (by := refused.get(what))}:
        print(f"{'refused':<24} " + "; ".join(f"{what} {by}" for what, by in said.items()))
    for e in report.get("engines") or []:
        hits = e.get("prefix_cache_hit_rate")
        cached = f", prefix cache hits {hits:.0%}" if hits is not None else ""
        print(f"engine {e['id']:<18} weight_version {e.get('weight_version')}{cached}")
    for warning in report.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    if report["status"] != "completed":
        print(f"job {report['status']}: {report.get('reason')}", file=sys.stderr)
        if "stuck" in report:
            print(f"what is stuck: see 'stuck' in {report.get('report_path')}", file=sys.stderr)
    print(f"report: {report.get('report_path')}")
    return 0 if report["status"] == "completed" and report.get("all_engines_on_final_version") else 1


def cmd_report(args: argparse.Namespace) -> int:
    """Reprints a finished run's summary from its report.json."""
    from tools.run_dirs import find_run

    run_dir, looked = find_run(args.run, args.runs_dir)
    if run_dir is None:
        print(f"no report for run {args.run!r}: looked in {', '.join(map(str, looked))}", file=sys.stderr)
        return 2
    path = run_dir / "report.json"
    report = json.loads(path.read_text())
    report.setdefault("report_path", str(path))
    return print_summary(report)


def cmd_export(args: argparse.Namespace) -> int:
    """Writes a run's trained policy in Hugging Face format (default: runs/<run>/final)."""
    from services.common.runconfig import load_run_config
    from tools.export import ExportError, export_policy
    from tools.run_dirs import find_run

    found, looked = find_run(args.run, args.runs_dir)
    run_dir = found or looked[0]
    report_path, config_path = run_dir / "report.json", run_dir / "config.yaml"
    if found is None or not config_path.is_file():
        where = ", ".join(map(str, looked))
        print(f"no run at {where} (a run there needs report.json and config.yaml)", file=sys.stderr)
        return 2
    report = json.loads(report_path.read_text())
    cfg = load_run_config(config_path)
    checkpoint = Path(args.checkpoint or report.get("checkpoint") or "")
    try:
        out = export_policy(cfg, checkpoint, Path(args.out or run_dir / "final"), run_id=report["run_id"])
    except ExportError as e:
        print(f"cannot export {args.run}: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {cfg.model.source} policy of run {report['run_id']} (Hugging Face format)")
    return 0


def cmd_credentials(args: argparse.Namespace) -> int:
    import yaml

    from services.common.credentials import generate, k8s_secrets

    workers = [w.strip() for w in args.workers.split(",") if w.strip()] if args.workers else None
    try:
        tls = (args.k8s_namespace or "libra") if args.tls else None
        creds = generate(Path(args.dir), workers=workers, owner_uid=args.owner, tls_namespace=tls)
    except ValueError as err:
        print(f"libra credentials: {err}", file=sys.stderr)
        return 2
    if args.k8s_namespace:
        print(yaml.safe_dump_all(k8s_secrets(creds, args.k8s_namespace), sort_keys=False), end="")
    else:
        each = "worker" if workers else "service kind"
        print(f"credentials in {creds.root} (one directory per {each} and cli; nats/ and redis/ configs)")
    return 0


def header_summary(text: str) -> str:
    """The first sentence of a config's header comment (however many lines it spans)."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    words = " ".join(w for w in header if w)
    return re.split(r"(?<=[.!?])\s", words, maxsplit=1)[0]


def cmd_config_list(_: argparse.Namespace) -> int:
    """The shipped configs, each with the first sentence of its header comment, wrapped."""
    for name in shipped_configs():
        lines = textwrap.wrap(header_summary((CONFIG_DIR / name).read_text()), 76) or [""]
        print(f"{name:<22} {lines[0]}")
        for more in lines[1:]:
            print(f"{'':<22} {more}")
    print(
        f"({CONFIG_DIR.resolve()}; `libra run NAME`, or `libra config show NAME > mine.yaml` to start your own)"
    )
    return 0


def cmd_config_show(args: argparse.Namespace) -> int:
    """The config as written (comments and all), or, with overrides or `--resolved`, every field
    as `libra run` would use it."""
    if not (args.resolved or args.overrides):
        print(config_path(args.name).read_text(), end="")
        return 0
    import yaml

    from services.common.runconfig import RunConfig

    path, cfg = _load(args.name, args.overrides)
    assert isinstance(cfg, RunConfig)
    with_ = f" with {' '.join(args.overrides)}" if args.overrides else ""
    print(f"# {path}{with_}, resolved (every field, defaults included)")
    print(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False), end="")
    return 0


def cmd_config_plan(args: argparse.Namespace) -> int:
    """The layout `planner.layout.search` would choose for a config, starting nothing."""
    import yaml

    from services.common.runconfig import RunConfig
    from tools.layout import choose_layout, summary

    path, cfg = _load(args.file, [*args.overrides, "planner.layout.search=true"])
    assert isinstance(cfg, RunConfig)
    chosen, decision = choose_layout(cfg)
    print(summary(decision))
    for why in decision["left_out"]:
        print(f"  left out: {why}")
    if args.out:
        Path(args.out).write_text(yaml.safe_dump(chosen.model_dump(mode="json"), sort_keys=False))
        print(f"wrote the chosen layout's config to {args.out}")
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    """Validates a run config, reads its dataset and loads its reward, starting nothing."""
    from services.common.runconfig import RunConfig
    from tools.runner import check_task

    path, cfg = _load(args.file, args.overrides)  # a bad field exits with its message
    assert isinstance(cfg, RunConfig)
    check_task(cfg)
    if (up := read_stack_file()) is not None:  # the stack `libra run` here would use
        engines = Stack.attach(up).engines() or set()
        if cfg.engines_needed > len(engines):
            print(
                f"invalid configuration: rollout.engines: the job needs {cfg.engines_needed} rollout "
                f"engine(s), the stack {up['name']} `libra run` would use here ({up['stack_file']}) runs "
                f"{len(engines)}: run with --rollout.engines {len(engines)}, start a stack with `libra up "
                f"--engines {cfg.engines_needed}`, or `libra run --embedded`",
                file=sys.stderr,
            )
            return 2
    from services.scheduler.feed import task_list

    print(
        f"{path}: ok — {len(task_list(cfg.task))} prompts × {cfg.task.group_size} samples, "
        f"{cfg.training.steps} steps of {cfg.training.groups_per_step} groups, "
        f"{cfg.rollout.engines} {cfg.rollout.backend} engine(s), model {cfg.model.source}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`libra`: a closed pipe (`libra trace | head`) ends the command quietly, as for any tool."""
    try:
        return _main(argv)
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # the interpreter's own flush at exit must not fail too
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports it


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:
        from tools.sim.cli import main as sim_main

        return sim_main(argv[1:])
    if argv[:2] == ["bench", "live"]:
        from tools.bench_live import main as bench_live_main

        return bench_live_main(argv[2:])
    if argv[:1] == ["trace"]:
        from tools.trace_view import main as trace_main

        return trace_main(argv[1:])
    if argv[:1] == ["calibrate"]:
        from tools.calibrate import main as calibrate_main

        return calibrate_main(argv[1:])
    if argv[:1] == ["samples"]:
        from tools.samples import main as samples_main

        return samples_main(argv[1:])
    if argv[:1] == ["sandbox"]:
        from services.tool_sandbox.cli import main as sandbox_main

        return sandbox_main(argv[1:])
    p = parser()
    args = parse(p, argv)
    return int(args.fn(args))


def parse(p: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The command line as `libra` reads it: config overrides (`--a.b v`) into `args.overrides`."""
    args, extra = p.parse_known_args(argv)
    if args.fn in (cmd_run, cmd_config_check, cmd_config_plan, cmd_config_show):
        try:
            args.overrides = config_overrides(extra)
        except ValueError as e:
            p.error(str(e))
    elif extra:
        p.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


OUTPUT_DIR = ("--output-dir", "--runs-dir")
"""The one flag every command that reads or writes runs/<run-id>/ takes (the second is its old name)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="libra", description="Libra: resource management for agentic RL post-training"
    )
    p.add_argument("--version", action="version", version=f"libra {_version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser(
        "up",
        help="start nats-server, redis and the five services, idle until `libra run` submits a job "
        "(foreground; Ctrl-C stops)",
    )
    up.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help="run config that sizes the stack (rollout.engines) and prepares its model, as for "
        "`libra run` (default: configs/default.yaml); jobs bring their own config",
    )
    up.add_argument("--config", dest="config_option", help=argparse.SUPPRESS)  # the old spelling
    up.add_argument("--engines", type=int, help="rollout engines to start (default: the config's)")
    up.add_argument(
        "--standby-trainers",
        type=int,
        default=0,
        help="trainers that stand by and take over when the active one's lease runs out (default 0)",
    )
    up.add_argument(
        "--standby-schedulers",
        type=int,
        default=0,
        help="schedulers that stand by, warm, and take over when the active one's lease runs out "
        "(default 0: a dead scheduler is restarted)",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restart a service that dies, with backoff, up to this many times (0: never)",
    )
    up.add_argument("--name", help="stack name (default: stack-<time>); logs go to runs/<name>/logs")
    up.add_argument("--otlp-endpoint", help="send traces to this OTLP gRPC endpoint (e.g. Jaeger's :4317)")
    up.set_defaults(fn=cmd_up)
    sub.add_parser("down", help="stop the stack started by `libra up`").set_defaults(fn=cmd_down)
    sub.add_parser("status", help="show the stack's processes").set_defaults(fn=cmd_status)
    run = sub.add_parser(
        "run",
        help="run a job on the stack `libra up` started (or on an embedded one) and write "
        "runs/<run-id>/report.json",
    )
    run.add_argument(
        "config",
        nargs="?",
        default=DEFAULT_CONFIG,
        help="run config: a file, or a shipped config by name (`libra config list`; default: "
        "default.yaml); any field can be overridden after it: "
        "--training.lr 1e-6, --task.max_turns=4 or rollout.engines=3 (YAML values)",
    )
    run.add_argument("--run-id")
    run.add_argument(
        *OUTPUT_DIR,
        dest="output_dir",
        default="runs",
        help="where runs/<run-id>/ goes: report, plots, traces, the exported policy (default: ./runs)",
    )
    run.add_argument(
        "--timeout",
        type=float,
        help="end the job as timed_out after this many seconds (default: none; stalls are caught by "
        "the config's job.stall_timeout_s)",
    )
    run.add_argument(
        "--nats-url",
        help="run on a stack elsewhere (compose, Kubernetes, another host) reached at this NATS URL; "
        "with --redis-url and, when it has credentials, --secrets",
    )
    run.add_argument("--redis-url", help="that stack's Redis URL")
    run.add_argument(
        "--secrets", help="that stack's credentials directory: the cli identity's files in DIR/cli/"
    )
    run.add_argument(
        "--tls-ca-file",
        help="that stack serves TLS: the CA its NATS and engines' WeightSync are verified with "
        "(default: $LIBRA_TLS_CA_FILE)",
    )
    run.add_argument(
        "--tls-cert-file",
        help="the CLI's certificate, where the stack asks for one (mutual TLS; default: $LIBRA_TLS_CERT_FILE)",
    )
    run.add_argument(
        "--tls-key-file",
        help="its key (default: $LIBRA_TLS_KEY_FILE)",
    )
    run.add_argument(
        "--embedded",
        action="store_true",
        help="run on an embedded stack of its own even where `libra up` started one (here or in a "
        "directory above, which jobs use by default)",
    )
    run.add_argument("--otlp-endpoint", help="embedded stack only: send traces to this OTLP endpoint")
    run.add_argument(
        "--max-restarts", type=int, default=5, help="embedded stack only: restarts of a service that dies"
    )
    run.set_defaults(fn=cmd_run)
    creds = sub.add_parser(
        "credentials",
        help="write a stack's credentials to DIR (kept if already there; `libra up` does this itself), "
        "or print them as Kubernetes Secrets",
    )
    creds.add_argument("dir", help="where the credentials live (created mode 0700)")
    creds.add_argument("--owner", type=int, help="hand the services' files to this uid (run as root)")
    creds.add_argument("--k8s-namespace", help="print the credentials as Secrets of this namespace")
    creds.add_argument(
        "--tls",
        action="store_true",
        help="also a CA of the stack's own (kept in DIR/tls/) and a certificate for every identity, "
        "NATS and Redis, named for compose's services and the namespace's Kubernetes Services",
    )
    creds.add_argument(
        "--workers",
        help="comma-separated worker ids (e.g. planner,rollout-engine-0,...): an identity per worker, "
        "each allowed to speak only for itself; without it, one per service kind, shared by its workers",
    )
    creds.set_defaults(fn=cmd_credentials)
    rep = sub.add_parser("report", help="reprint a run's summary from runs/<run>/report.json")
    rep.add_argument("run", nargs="?", default="latest", help="run id (default: the last run)")
    add_output_dir(rep)
    rep.set_defaults(fn=cmd_report)
    exp = sub.add_parser(
        "export", help="write a run's trained policy in Hugging Face format (model and tokenizer)"
    )
    exp.add_argument("run", nargs="?", default="latest", help="run id (default: the last run)")
    add_output_dir(exp)
    exp.add_argument("--out", help="directory to write (default: runs/<run>/final)")
    exp.add_argument("--checkpoint", help="a trainer checkpoint (default: the run's committed one)")
    exp.set_defaults(fn=cmd_export)
    config = sub.add_parser(
        "config",
        help="`libra config check FILE`: validate a run config; `plan FILE`: the layout the planner "
        "would search for it; `list`/`show NAME`: the shipped ones",
    )
    config_sub = config.add_subparsers(dest="config_cmd", required=True)
    check = config_sub.add_parser(
        "check", help="validate FILE, read its dataset and load its reward, starting nothing"
    )
    check.add_argument("file", help="run config; overrides after it as for `libra run`")
    check.set_defaults(fn=cmd_config_check)
    plan = config_sub.add_parser(
        "plan",
        help="the layout the simulator's planner chooses for FILE from its workload "
        "(planner.layout.search), starting nothing",
    )
    plan.add_argument("file", help="run config; overrides after it as for `libra run`")
    plan.add_argument("--out", help="write the chosen layout's run config here (YAML)")
    plan.set_defaults(fn=cmd_config_plan)
    config_sub.add_parser("list", help="the configs shipped with Libra").set_defaults(fn=cmd_config_list)
    show = config_sub.add_parser(
        "show",
        help="print a config (a shipped one by name: a starting point for your own); with overrides "
        "or --resolved, every field as `libra run` would use it",
    )
    show.add_argument("name", help="e.g. tiny, gpu.yaml, or a file; overrides after it as for `libra run`")
    show.add_argument("--resolved", action="store_true", help="every field, defaults included")
    show.set_defaults(fn=cmd_config_show)
    sub.add_parser("sim", help="discrete-event simulator (see `libra sim --help`)")
    sub.add_parser("sandbox", help="run one tool call in the sandbox (see `libra sandbox --help`)")
    sub.add_parser(
        "trace",
        help="`libra trace [TRAJECTORY_ID] [--run RUN]`: a trajectory's waterfall from the run's span files "
        "(no id: the slowest trajectories)",
    )
    sub.add_parser(
        "calibrate",
        help="`libra calibrate --backend vllm|hf [--model M] [--out PROFILE]`: measure the engine on this "
        "machine and fit the simulator's cost model to it (`libra sim --profile PROFILE`)",
    )
    sub.add_parser(
        "samples",
        help="`libra samples [RUN] [--step N] [--worst|--best]`: a run's trajectories as text (prompt, "
        "turns, tool calls and what came back, reward, advantage), from runs/<run>/samples.jsonl",
    )
    sub.add_parser(
        "bench",
        help="`libra bench live`: the live stack (emulated engines) against the simulator's prediction "
        "(see `libra bench live --help`)",
    )
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("libra")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


if __name__ == "__main__":
    raise SystemExit(main())
