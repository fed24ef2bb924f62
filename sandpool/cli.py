"""The ``sandpool`` command line: ``run`` (the main job), ``validate``, ``bench``, ``build-pack``, ``images``
(:mod:`sandpool.cli_images`) and ``gc``."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape

from sandpool.cli_images import images_app
from sandpool.core import errors
from sandpool.core.base import Backend, ResourceLimits
from sandpool.core.metrics import Outcome, RejectedTask, RolloutResult
from sandpool.core.paths import sandpool_home
from sandpool.core.pool import PoolLimits
from sandpool.progress import Progress

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode="markdown",
                  help="Warm pools of isolated sandboxes for SWE-style RL and evaluation.")
console = Console(stderr=True)


def _default_tasks() -> Path:
    from sandpool.envs.taskpack import RichBuildProgress, build_default_pack

    console.print("[bold]task pack[/]: the default pack (built on the first run, then cached)")
    with RichBuildProgress(console) as show:
        return build_default_pack(progress=show)


def _validate_first(task_list: list, *, grade_timeout: float = 300.0,
                    backend: Callable[[], Backend] | None = None) -> tuple[list, list[RejectedTask]]:
    """The tasks worth running and the rows rejected: every task not validated before on its
    image is validated once (gold and empty patch, cached under sandpool_home()), on sandboxes
    of ``backend()`` (default: the local backend)."""
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.grading.validate import validated

    with Progress("validate", None, console, transient=True) as bar:

        def start(n: int) -> None:
            bar.set_total(n)
            if n:
                console.print(f"[bold]validate[/]: gold and empty patch on {n} task(s) not validated "
                              "on their image before (once; --no-validate skips)")

        runnable, broken, _ = asyncio.run(validated(
            task_list, backend or LocalBackend, concurrency=2, grade_timeout=grade_timeout, on_start=start,
            on_result=lambda v: bar.advance()))
    return runnable, broken


def _backend_factory(name: str, *, network: bool, kubeconfig: str, namespace: str, node_selector: str,
                     tolerate: str, disk_mib: int) -> Callable[[], Backend]:
    """What makes the run's backend (for validation and for the run), from ``run``'s options.

    Raises:
        InputError: An unknown backend, or a malformed --node-selector.
    """
    from sandpool.core.backends.local import LocalBackend

    if name == "local":
        return lambda: LocalBackend(limits=ResourceLimits(network=network))
    if name != "kubernetes":
        raise errors.InputError(f"--backend {name!r}: use local or kubernetes")
    from sandpool.core.backends.kubernetes import KubernetesBackend

    pairs = [p for p in node_selector.split(",") if p]
    if any("=" not in p for p in pairs):
        raise errors.InputError(f"--node-selector {node_selector!r}: give key=value[,key=value]")
    opts = {"namespace": namespace, "node_selector": dict(p.split("=", 1) for p in pairs),
            "tolerations": [{"key": k, "operator": "Exists", "effect": "NoSchedule"}
                            for k in tolerate.split(",") if k],
            "disk_bytes": disk_mib << 20 or None, "agent_entrypoint": True}
    return lambda: KubernetesBackend(kubeconfig or None, **opts)


def _no_task_file(tasks: str, exc: FileNotFoundError) -> str:
    """The message for a missing file: naming --tasks and the fix when that is what is missing."""
    if tasks != "default" and not Path(tasks).exists():
        return (f"--tasks {tasks}: no such file; give a .jsonl, .json or .parquet task file, a hub "
                "dataset name, or 'default' for the built-in pack")
    return str(exc)


def _check_rows(tasks: str, task_list: list, rejected: list[RejectedTask]) -> None:
    """Refuse a task file that holds no row at all (an empty file, blank lines only).

    Raises:
        InputError: No task and no rejected row came from ``tasks``.
    """
    if not task_list and not rejected:
        raise errors.InputError(f"--tasks {tasks}: the file holds no task rows; give one task per line "
                                "(.jsonl), a list of tasks (.json, .parquet), or 'default' for the built-in pack")


def _validate(path: Path, tasks_out: Path, report_out: Path, *, concurrency: int,
              grade_timeout: float = 300.0) -> int:
    from sandpool.core.backends.local import LocalBackend
    from sandpool.envs.grading.validate import ValidationCache, validate_tasks
    from sandpool.envs.tasks import load_tasks, local_base_resolver

    rejected: list[RejectedTask] = []
    task_list = load_tasks(path, rejected=rejected, resolve_base=local_base_resolver())
    _check_rows(str(path), task_list, rejected)
    with Progress("validate", len(task_list), console) as bar:
        result = asyncio.run(validate_tasks(task_list, LocalBackend, concurrency=concurrency,
                                            grade_timeout=grade_timeout, rejected=rejected,
                                            on_result=lambda v: bar.advance(),
                                            cache=ValidationCache()))
    result.write(tasks_out, report_out)
    print(result.render_text())
    console.print(f"passing tasks: {tasks_out}  verdicts: {report_out}", soft_wrap=True)
    return len(result.broken)


@app.command()
def run(
    tasks: Annotated[str, typer.Option(help="Task file (.jsonl/.json/.parquet of SWE-bench, R2E-Gym, SWE-smith or "
                                            "sandpool rows), a hub dataset name, or 'default' for the built-in "
                                            "pack.")] = "default",
    rollouts: Annotated[int, typer.Option(min=1, help="Rollouts per task (k), at least 1.")] = 4,
    limit: Annotated[int, typer.Option(min=0, help="Run only the first N tasks (0 = all).")] = 0,
    policy: Annotated[str, typer.Option(help="Comma-separated policies used round-robin: oracle, noop, chat.")] = "oracle,noop",
    concurrency: Annotated[int, typer.Option(min=1, help="Rollouts at once.")] = 8,
    strategy: Annotated[str, typer.Option(help="cold, warm or reuse.")] = "reuse",
    retries: Annotated[int, typer.Option(min=0, help="Infra retries per rollout.")] = 2,
    out: Annotated[Path, typer.Option(help="Directory for report.json, report.txt, rollouts.jsonl.")] = Path("reports/run"),
    resume: Annotated[bool, typer.Option(help="Continue a run from out/rollouts.jsonl.")] = False,
    chat_url: Annotated[str, typer.Option(help="OpenAI-compatible endpoint for the chat policy.")] = "",
    model: Annotated[str, typer.Option(help="Model name for the chat policy.")] = "",
    network: Annotated[bool, typer.Option(help="Give sandboxes network access (local backend).")] = False,
    backend: Annotated[str, typer.Option(help="local (bubblewrap) or kubernetes (pods; the task's image is the "
                                              "container image).")] = "local",
    kubeconfig: Annotated[str, typer.Option(help="--backend kubernetes: kubeconfig (default: $KUBECONFIG or "
                                                 "~/.kube/config).")] = "",
    namespace: Annotated[str, typer.Option(help="--backend kubernetes: namespace of the pods.")] = "default",
    node_selector: Annotated[str, typer.Option(help="--backend kubernetes: nodeSelector of the pods, "
                                                    "key=value[,key=value].")] = "",
    tolerate: Annotated[str, typer.Option(help="--backend kubernetes: taint keys the pods tolerate "
                                               "(NoSchedule), comma-separated.")] = "",
    disk_mib: Annotated[int, typer.Option(min=0, help="--backend kubernetes: cap on what a sandbox writes (its "
                                                      "workdir copy and /tmp, in memory), read-only root; 0: off.")] = 0,
    metrics_port: Annotated[int, typer.Option(help="Serve Prometheus metrics at http://127.0.0.1:PORT/metrics while running (0 = off).")] = 0,
    no_validate: Annotated[bool, typer.Option("--no-validate", help="Do not validate tasks first. By default each task "
                                              "not validated on its image before gets its gold and empty patch graded "
                                              "once (cached), and a broken task is rejected instead of run.")] = False,
) -> None:
    """Run N tasks x k rollouts on the local backend or on Kubernetes pods, with a progress bar and a
    report."""
    from sandpool.envs.policies import get_policy
    from sandpool.envs.runner import run_batch
    from sandpool.envs.tasks import load_tasks, local_base_resolver

    from sandpool.core.strategies import get_strategy

    try:  # before the pack is built or a task validated
        get_strategy(strategy)
    except errors.ConfigError:
        console.print(f"[red]error:[/] --strategy {strategy}: use cold, warm or reuse", soft_wrap=True)
        raise typer.Exit(2) from None
    try:
        # The options first: a typo is reported before the task pack is built (minutes, once).
        make_backend = _backend_factory(backend, network=network, kubeconfig=kubeconfig, namespace=namespace,
                                        node_selector=node_selector, tolerate=tolerate, disk_mib=disk_mib)
        policies = [get_policy(p.strip(), base_url=chat_url, model=model) for p in policy.split(",") if p.strip()]
        path = _default_tasks() if tasks == "default" else Path(tasks)
        rejected: list[RejectedTask] = []
        rows: dict[str, int] = {}
        task_list = load_tasks(path, rejected=rejected, rows=rows,
                               resolve_base=local_base_resolver() if backend == "local" else None)
        _check_rows(tasks, task_list, rejected)
        if limit:
            task_list = task_list[:limit]
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/] {escape(_no_task_file(tasks, exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except errors.InputError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if not no_validate:
        try:
            task_list, broken = _validate_first(task_list, backend=make_backend)
        except errors.FatalError as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
        rejected += [r.model_copy(update={"row": rows.get(r.task_id or "")}) for r in broken]
    for r in rejected:
        console.print(f"[yellow]rejected[/] {escape(r.describe())}", soft_wrap=True)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "rollouts.jsonl"
    if not resume:
        results_path.unlink(missing_ok=True)
    counts = {o: 0 for o in Outcome}
    metrics = None
    if metrics_port:
        from sandpool.core.telemetry import PoolMetrics

        metrics = PoolMetrics()
        try:
            metrics.serve(metrics_port)
        except OSError as exc:
            console.print(f"[red]error:[/] --metrics-port {metrics_port}: {escape(str(exc))}; pick a free port",
                          soft_wrap=True)
            raise typer.Exit(2) from None
        console.print(f"metrics: http://127.0.0.1:{metrics_port}/metrics")

    # Rejected rows count as the rollouts they would have been: the bar ends at its total.
    with Progress("rollouts", (len(task_list) + len(rejected)) * rollouts, console) as bar:

        def on_result(r: RolloutResult) -> None:
            counts[r.outcome] += 1
            bar.advance("  ".join(f"{o.value} {n}" for o, n in counts.items()))

        try:
            report = asyncio.run(run_batch(
                task_list, policies, make_backend(), rollouts_per_task=rollouts, concurrency=concurrency,
                strategy=strategy, limits=PoolLimits(), retries=retries, results_path=results_path,
                resume=resume, rejected=rejected, rows=rows, on_result=on_result, metrics=metrics))
        except KeyboardInterrupt:
            console.print(f"[yellow]interrupted[/]: finished rollouts are kept in {results_path}; "
                          "rerun with --resume to continue")
            raise typer.Exit(130) from None
        except (errors.FatalError, errors.InputError) as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
    js, txt = report.write(out)
    print(report.render_text())
    console.print(f"reports: {txt}  {js}  {results_path}", soft_wrap=True)  # whole paths in a log


@app.command()
def validate(
    tasks: Annotated[str, typer.Option(help="Task file or hub name (as for run), or 'default'.")] = "default",
    out: Annotated[Path, typer.Option(help="Directory for validated.jsonl (the passing tasks) and validation.json.")] = Path("reports/validate"),
    concurrency: Annotated[int, typer.Option(min=1, help="Tasks at once.")] = 2,
    grade_timeout: Annotated[float, typer.Option(help="Seconds for each grading test run.")] = 300.0,
) -> None:
    """Grade the gold and the empty patch of every task; report broken tasks, write the passing ones.

    A task is broken when the patch policy refuses its gold patch, when the gold patch does not
    resolve it (the reason names the FAIL_TO_PASS / PASS_TO_PASS tests that failed or were
    absent, and why), when the empty patch does, or when grading finds the task itself broken.
    Use the written validated.jsonl with 'sandpool run --tasks'; 'sandpool run' also reads the
    verdicts this stores. Exits 1 when any task is broken.
    """
    try:
        path = _default_tasks() if tasks == "default" else Path(tasks)
        broken = _validate(path, out / "validated.jsonl", out / "validation.json", concurrency=concurrency,
                           grade_timeout=grade_timeout)
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/] {escape(_no_task_file(tasks, exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except (errors.InputError, errors.FatalError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    if broken:
        raise typer.Exit(1)


@app.command()
def bench(
    backend: Annotated[str, typer.Option(help="local or kubernetes.")] = "local",
    strategies: Annotated[str, typer.Option(help="Comma-separated, run in this order. local: cold, warm, reuse, "
                                                 "docker-run, docker-exec; kubernetes: pods, warm, reuse.")] = "",
    tasks: Annotated[str, typer.Option(help="oci (the SWE-bench-shaped OCI test image, one name per task), "
                                            "default (the task pack) or a task file.")] = "oci",
    limit: Annotated[int, typer.Option(min=1, help="Tasks, spread over their images.")] = 8,
    rollouts: Annotated[int, typer.Option(min=1, help="Rollouts per task.")] = 4,
    concurrency: Annotated[int, typer.Option(min=1, help="Rollouts at once, for every strategy.")] = 8,
    out: Annotated[Path, typer.Option(help="Directory for `bench_<backend>.{txt,json}` and the plots.")] = Path("reports/bench"),
    kubeconfig: Annotated[Path | None, typer.Option(help="kubernetes: the cluster (default: $KUBECONFIG, "
                                                          "~/.kube/config).")] = None,
    simulate: Annotated[bool, typer.Option("--simulate", help="Run no sandbox: the Kubernetes burst's "
                                           "discrete-event model, its error on the measured shapes and its "
                                           "predictions (seed shape; 30,000 over 1, 3, 10 clusters).")] = False,
) -> None:
    """Measure sandpool's strategies beside Docker (or plain pods) and the exec round trip, side by side.

    Prints the table (TTFC mean/p50/p99/max, the exec round trip in a claimed sandbox, rollouts
    per minute, host CPU per rollout, ...) with its targets, and writes text, JSON and the TTFC
    CDF (plus the timeline on Kubernetes). The Docker strategies start a Docker daemon of their
    own (Debian's docker.io) and stop it after.
    """
    if simulate:
        try:
            from sandpool.bench.predict import main as predict
        except ImportError as exc:
            fix = escape("in sandpool's clone, pip install -e '.[sim]'")  # [sim] is not rich markup
            console.print(f"[red]error:[/] --simulate needs {exc.name}: {fix}", soft_wrap=True)
            raise typer.Exit(2) from None
        predict(["--out", str(out)])
        written = [out / n for n in ("simulate.txt", "simulate.json", "simulate_ttfc_cdf.png")]
        console.print("reports: " + "  ".join(str(p) for p in written if p.exists()), soft_wrap=True)
        return
    from sandpool.bench import BenchConfig, run_bench

    try:
        default = "cold,warm,reuse,docker-run,docker-exec" if backend == "local" else "pods,warm,reuse"
        cfg = BenchConfig(backend=backend, strategies=tuple(s.strip() for s in (strategies or default).split(",")
                                                            if s.strip()),
                          tasks=tasks, limit=limit, rollouts=rollouts, concurrency=concurrency, out=out,
                          kubeconfig=kubeconfig)
        report = asyncio.run(run_bench(cfg, say=lambda line: console.print(line, highlight=False)))
    except ValidationError as exc:
        err = exc.errors()[0]
        option = "--" + "-".join(str(x) for x in err["loc"])
        console.print(f"[red]error:[/] {option}: {escape(err['msg'])}", soft_wrap=True)
        raise typer.Exit(2) from None
    except FileNotFoundError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    except (errors.InputError, errors.FatalError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    print(report.render_text())
    try:
        paths = report.write(out, f"bench_{backend}")
    except errors.FatalError as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    console.print("reports: " + "  ".join(str(p) for p in paths), soft_wrap=True)


@app.command("build-pack")
def build_pack() -> None:
    """Build (or reuse) the default task pack: image directories and tasks.jsonl."""
    print(_default_tasks())


@app.command()
def gc(
    run_id: Annotated[str, typer.Option(help="Also delete this run's Kubernetes objects (label sandpool.io/run-id).")] = "",
    kubeconfig: Annotated[str, typer.Option(help="Kubeconfig for --run-id (default: $KUBECONFIG or ~/.kube/config).")] = "",
    namespace: Annotated[str, typer.Option(help="Namespace for --run-id.")] = "default",
) -> None:
    """Remove what dead local runs left behind; with --run-id, that run's Kubernetes objects.

    Kubernetes: deletes the SandboxClaims, SandboxWarmPools, SandboxTemplates and Pods labelled
    ``sandpool.io/run-id=<run-id>`` in the namespace, and nothing else.
    """
    from sandpool.core.backends.local import reap_stale

    reaped = reap_stale(sandpool_home() / "local")
    print(f"reaped {len(reaped)} dead local runs" + (f": {', '.join(reaped)}" if reaped else ""))
    if run_id:
        from sandpool.core.backends import kubernetes

        try:
            found = asyncio.run(kubernetes.gc(run_id, kubeconfig=kubeconfig or None, namespace=namespace))
        except errors.SandpoolError as exc:
            console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
            raise typer.Exit(2) from None
        print(f"run {run_id} in namespace {namespace}: deleted "
              + ", ".join(f"{n} {res}" for res, n in found.items()))


app.add_typer(images_app, name="images")


def main() -> None:  # pragma: no cover - console entry
    """Entry point for ``python -m sandpool``."""
    app(prog_name="sandpool")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
